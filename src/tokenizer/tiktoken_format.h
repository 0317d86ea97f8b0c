#pragma once
// tiktoken rank files: one line per token, "base64(token bytes) rank". The file holds neither
// the pre-tokenisation pattern nor the special tokens; they come with it (for the official
// encodings, by name).
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/pattern.h"
#include "tokenizer/tokenizer.h"

namespace pollen::tokenizer {

// The special tokens of an official encoding (as tiktoken defines them; none for qwen2).
std::vector<AddedToken> known_special_tokens(KnownPattern pattern);
// The number of ranks in the encoding's own rank file (whose ids its special tokens follow).
int64_t known_rank_count(KnownPattern pattern);

// Reads a rank file; `pattern` is a pre-tokenisation regex (use known_pattern_regex for the
// official ones). Errors name the file and the line.
Tokenizer load_tiktoken(const std::filesystem::path& path, std::string pattern,
                        std::vector<AddedToken> special_tokens);
Tokenizer tiktoken_from_text(std::string_view text, std::string_view source, std::string pattern,
                             std::vector<AddedToken> special_tokens);

// Writes the model's tokens as a rank file (rank = id). Only a byte-level tokenizer whose ids
// follow its merge order can be written: otherwise tiktoken would merge differently.
std::string tiktoken_text(const Tokenizer& tokenizer);
void save_tiktoken(const Tokenizer& tokenizer, const std::filesystem::path& path);

std::string base64_encode(std::string_view bytes);
// nullopt when `text` is not canonical padded base64.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace pollen::tokenizer
