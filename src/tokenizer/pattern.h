#pragma once
// Pre-tokenisation patterns: the regexes that cut text into pieces before BPE.
//
// The patterns of GPT-2 (r50k), cl100k_base (also Llama 3), o200k_base and Qwen2 are matched
// by hand-written code that follows the regex's leftmost-first semantics exactly (and is many
// times faster than a regex engine). Any other pattern is run by ICU's regex engine, with \s
// read as Unicode White_Space as in Rust's regex and Oniguruma.
//
// Text that is not valid UTF-8 (which regexes cannot see) is handled by one rule: the text is
// cut into maximal valid UTF-8 runs and single invalid bytes; each invalid byte is a piece of
// its own, and each valid run is matched as if it were the whole text.
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace pollen::tokenizer {

enum class KnownPattern { kGpt2, kCl100k, kO200k, kQwen2 };

// The exact regex text of a known pattern (as tiktoken and HF tokenizer.json write it).
std::string_view known_pattern_regex(KnownPattern pattern);
// "gpt2" (or "r50k_base"), "cl100k_base", "o200k_base", "qwen2".
std::optional<KnownPattern> known_pattern_named(std::string_view name);
std::string_view known_pattern_name(KnownPattern pattern);
std::optional<KnownPattern> recognise_pattern(std::string_view regex);
// A pattern for messages: its known name ("gpt2"), or the regex quoted (its first 60 bytes).
std::string describe_pattern(std::string_view regex);

// A regex matching `text` as it is (tokenizer.json's {"String": ...}): every ASCII character
// that is not a letter or digit escaped (a control character as \x{HH}), so that no part of it
// is read as a class or an operator, by ICU or by Oniguruma.
std::string literal_regex(std::string_view text);
// The text a regex of that form matches, when it has that form (no operator, class or escape
// of a letter or digit); none otherwise.
std::optional<std::string> literal_of_regex(std::string_view regex);

// Length in bytes of the match that starts at `p` in valid UTF-8 text [p, end), p < end.
size_t known_pattern_match(KnownPattern pattern, const unsigned char* p, const unsigned char* end);

class IcuRegex;

// Splits text into the matches of one regex. Gaps that no match covers (possible with
// arbitrary patterns) are reported too, flagged as not matched; so are empty matches (a cut
// where the pattern matches the empty string), as empty pieces. Invalid bytes are reported as
// matched pieces of one byte.
class PatternSplitter {
 public:
  explicit PatternSplitter(std::string regex);
  ~PatternSplitter();
  PatternSplitter(PatternSplitter&&) noexcept;
  PatternSplitter& operator=(PatternSplitter&&) noexcept;

  const std::string& regex() const { return regex_; }
  std::optional<KnownPattern> known() const { return known_; }

  using Sink = std::function<void(std::string_view piece, bool matched)>;
  void split(std::string_view text, const Sink& sink) const;

 private:
  void split_valid(std::string_view text, const Sink& sink) const;

  std::string regex_;
  std::optional<KnownPattern> known_;
  std::unique_ptr<IcuRegex> icu_;
};

}  // namespace pollen::tokenizer
