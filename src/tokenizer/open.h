#pragma once
// Opening and saving tokenizer files by their kind: HF tokenizer.json (a .json file) or a
// tiktoken rank file (anything else).
#include <filesystem>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace pollen::tokenizer {

// A rank file needs its pattern: a known name (gpt2, cl100k_base, o200k_base, qwen2), which
// also brings that encoding's special tokens, or a regex. `special_tokens` are added to those.
Tokenizer open_tokenizer(const std::filesystem::path& path, const std::string& pattern,
                         std::vector<AddedToken> special_tokens = {});

// A known pattern name's regex, or `pattern` itself when it is not a known name.
std::string pattern_regex(const std::string& pattern);

void save_tokenizer(const Tokenizer& tokenizer, const std::filesystem::path& path);

}  // namespace pollen::tokenizer
