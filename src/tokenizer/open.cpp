#include "tokenizer/open.h"

#include <algorithm>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/tiktoken_format.h"

namespace pollen::tokenizer {

namespace {
bool is_json(const std::filesystem::path& path) {
  return path.extension() == ".json";
}

// The lines of a rank file that hold a rank.
int64_t rank_lines(std::string_view text) {
  int64_t n = 0;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    n += end > at && !(end == at + 1 && text[at] == '\r');
    at = end + 1;
  }
  return n;
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
    POLLEN_CHECK(pattern.empty(), path.string(),
                 ": tokenizer.json holds its own pre-tokenizer; a pattern is for rank files only");
    return load_hf_json(path);
  }
  POLLEN_CHECK(
      !pattern.empty(), path.string(),
      ": a tiktoken rank file needs a pattern (gpt2, cl100k_base, o200k_base, qwen2, or a regex)");
  const std::string text = read_file(path);
  if (auto known = known_pattern_named(pattern)) {
    // The encoding's special tokens come with its own rank file only (their ids follow its
    // ranks); a file of another size made with the same pattern gets the pattern alone.
    // One also given by hand, as the same token at the same id, is taken once.
    std::vector<AddedToken> known_specials = known_special_tokens(*known);
    if (rank_lines(text) == known_rank_count(*known)) {
      std::erase_if(special_tokens, [&](const AddedToken& t) {
        return std::any_of(known_specials.begin(), known_specials.end(), [&](const AddedToken& k) {
          return k.id == t.id && k.content == t.content;
        });
      });
      special_tokens.insert(special_tokens.begin(), known_specials.begin(), known_specials.end());
    }
  }
  return tiktoken_from_text(text, path.string(), pattern_regex(pattern), std::move(special_tokens));
}

void save_tokenizer(const Tokenizer& tokenizer, const std::filesystem::path& path) {
  if (is_json(path))
    save_hf_json(tokenizer, path);
  else
    save_tiktoken(tokenizer, path);
}

}  // namespace pollen::tokenizer
