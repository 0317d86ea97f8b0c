#include "tokenizer/open.h"

#include "base/error.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/tiktoken_format.h"

namespace pollen::tokenizer {

namespace {
bool is_json(const std::filesystem::path& path) {
  return path.extension() == ".json";
}
}  // namespace

std::string pattern_regex(const std::string& pattern) {
  if (auto known = known_pattern_named(pattern)) return std::string(known_pattern_regex(*known));
  return pattern;
}

Tokenizer open_tokenizer(const std::filesystem::path& path, const std::string& pattern,
                         std::vector<AddedToken> special_tokens) {
  if (is_json(path)) {
    POLLEN_CHECK(special_tokens.empty(), path.string(),
                 ": tokenizer.json lists its own special tokens; do not pass more");
    return load_hf_json(path);
  }
  POLLEN_CHECK(
      !pattern.empty(), path.string(),
      ": a tiktoken rank file needs a pattern (gpt2, cl100k_base, o200k_base, qwen2, or a regex)");
  if (auto known = known_pattern_named(pattern)) {
    std::vector<AddedToken> known_specials = known_special_tokens(*known);
    special_tokens.insert(special_tokens.begin(), known_specials.begin(), known_specials.end());
  }
  return load_tiktoken(path, pattern_regex(pattern), std::move(special_tokens));
}

void save_tokenizer(const Tokenizer& tokenizer, const std::filesystem::path& path) {
  if (is_json(path))
    save_hf_json(tokenizer, path);
  else
    save_tiktoken(tokenizer, path);
}

}  // namespace pollen::tokenizer
