#include "tokenizer/pattern.h"

#include <unicode/regex.h>
#include <unicode/utext.h>

#include <array>
#include <cctype>
#include <cstdio>
#include <optional>
#include <string>

#include "base/error.h"
#include "tokenizer/unicode.h"

namespace pollen::tokenizer {

namespace {

constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kCl100kRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kO200kRegex =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

using Byte = unsigned char;

// One character of valid UTF-8 text: its class flags and its length in bytes (0 at the end).
struct Char {
  uint8_t cls;
  int len;
};

const std::array<uint8_t, 128>& ascii_classes() {
  static const std::array<uint8_t, 128> table = [] {
    std::array<uint8_t, 128> t{};
    for (int c = 0; c < 128; ++c) t[c] = char_class(static_cast<char32_t>(c));
    return t;
  }();
  return table;
}

inline Char peek(const Byte* p, const Byte* end) {
  if (p >= end) return {0, 0};
  if (*p < 0x80) return {ascii_classes()[*p], 1};
  Decoded d = decode_utf8(p, end);
  return {char_class(d.cp), d.length};
}

// End of the run of characters whose class has any of `flags`, starting at p.
inline const Byte* run_of(const Byte* p, const Byte* end, uint8_t flags) {
  for (Char c = peek(p, end); c.len && (c.cls & flags); c = peek(p, end)) p += c.len;
  return p;
}

// End of the run of characters that are neither letters, numbers nor white space.
inline const Byte* run_of_other(const Byte* p, const Byte* end) {
  for (Char c = peek(p, end); c.len && !(c.cls & (kLetter | kNumber | kSpace)); c = peek(p, end))
    p += c.len;
  return p;
}

inline bool is_other(Char c) {
  return c.len && !(c.cls & (kLetter | kNumber | kSpace));
}

// Matches 's|'t|'re|'ve|'m|'ll|'d at p (case-insensitively when asked, where 'ſ' folds to
// 's' as in Unicode simple case folding). Returns the length in bytes, 0 when none matches.
size_t contraction(const Byte* p, const Byte* end, bool ignore_case) {
  if (p >= end || *p != '\'') return 0;
  auto letter = [&](const Byte* q, char want) -> int {
    if (q >= end) return 0;
    Byte c = *q;
    if (ignore_case && c >= 'A' && c <= 'Z') c = static_cast<Byte>(c - 'A' + 'a');
    if (c == want) return 1;
    if (ignore_case && want == 's' && q + 1 < end && q[0] == 0xC5 && q[1] == 0xBF) return 2;
    return 0;
  };
  const Byte* q = p + 1;
  for (char single : {'s', 't', 'm', 'd'})
    if (int n = letter(q, single)) return 1 + n;
  for (auto [first, second] : {std::pair{'r', 'e'}, {'v', 'e'}, {'l', 'l'}}) {
    if (int n = letter(q, first))
      if (int m = letter(q + n, second)) return 1 + n + m;
  }
  return 0;
}

// \s+(?!\S)|\s+ at a white-space character p; with `line_breaks`, \s*[\r\n]+ is tried first.
size_t match_space(const Byte* p, const Byte* end, bool line_breaks) {
  const Byte* q = p;
  const Byte* last_start = p;
  const Byte* after_last_break = nullptr;
  for (Char c = peek(q, end); c.len && (c.cls & kSpace); c = peek(q, end)) {
    last_start = q;
    q += c.len;
    if (c.cls & kLineBreak) after_last_break = q;
  }
  if (line_breaks && after_last_break) return after_last_break - p;
  if (q == end || last_start == p) return q - p;
  return last_start - p;
}

size_t match_gpt2(const Byte* p, const Byte* end) {
  if (size_t n = contraction(p, end, false)) return n;
  Char c = peek(p, end);
  const Byte* q = p;
  Char d = c;
  if (*p == ' ') {
    q = p + 1;
    d = peek(q, end);
  }
  if (d.len) {
    if (d.cls & kLetter) return run_of(q, end, kLetter) - p;
    if (d.cls & kNumber) return run_of(q, end, kNumber) - p;
    if (is_other(d)) return run_of_other(q, end) - p;
  }
  return match_space(p, end, false);
}

// ` ?[^\s\p{L}\p{N}]+` followed by a run of the bytes in `tail` ("\r\n" or "\r\n/").
size_t match_punctuation(const Byte* p, const Byte* end, std::string_view tail) {
  const Byte* q = *p == ' ' ? p + 1 : p;
  if (!is_other(peek(q, end))) return 0;
  q = run_of_other(q, end);
  while (q < end && tail.find(static_cast<char>(*q)) != std::string_view::npos) ++q;
  return q - p;
}

size_t match_numbers(const Byte* p, const Byte* end, int max_count) {
  const Byte* q = p;
  for (int i = 0; i < max_count; ++i) {
    Char c = peek(q, end);
    if (!c.len || !(c.cls & kNumber)) break;
    q += c.len;
  }
  return q - p;
}

inline bool is_word_prefix(Char c) {
  return !(c.cls & (kLetter | kNumber | kLineBreak));
}

size_t match_cl100k(const Byte* p, const Byte* end, int max_digits) {
  if (size_t n = contraction(p, end, true)) return n;
  Char c = peek(p, end);
  if (is_word_prefix(c)) {
    const Byte* q = p + c.len;
    if (peek(q, end).cls & kLetter) return run_of(q, end, kLetter) - p;
  }
  if (c.cls & kLetter) return run_of(p, end, kLetter) - p;
  if (c.cls & kNumber) return match_numbers(p, end, max_digits);
  if (size_t n = match_punctuation(p, end, "\r\n")) return n;
  return match_space(p, end, true);
}

// o200k's first word alternative at q: [upper-like]*[lower-like]+ then an optional contraction.
const Byte* o200k_word_lower(const Byte* q, const Byte* end) {
  const Byte* k = q;
  const Byte* last_lower = nullptr;
  Char c = peek(k, end);
  for (; c.len && (c.cls & kUpperLike); c = peek(k, end)) {
    if (c.cls & kLowerLike) last_lower = k;
    k += c.len;
  }
  const Byte* e;
  if (c.len && (c.cls & kLowerLike)) {
    e = run_of(k, end, kLowerLike);
  } else if (last_lower) {
    e = last_lower + peek(last_lower, end).len;
  } else {
    return nullptr;
  }
  return e + contraction(e, end, true);
}

// o200k's second word alternative at q: [upper-like]+[lower-like]* then an optional contraction.
const Byte* o200k_word_upper(const Byte* q, const Byte* end) {
  const Byte* k = run_of(q, end, kUpperLike);
  if (k == q) return nullptr;
  const Byte* e = run_of(k, end, kLowerLike);
  return e + contraction(e, end, true);
}

size_t match_o200k(const Byte* p, const Byte* end) {
  Char c = peek(p, end);
  bool prefix = is_word_prefix(c);
  for (auto word : {o200k_word_lower, o200k_word_upper}) {
    if (prefix)
      if (const Byte* e = word(p + c.len, end)) return e - p;
    if (const Byte* e = word(p, end)) return e - p;
  }
  if (c.cls & kNumber) return match_numbers(p, end, 3);
  if (size_t n = match_punctuation(p, end, "\r\n/")) return n;
  return match_space(p, end, true);
}

bool ascii_alnum(unsigned char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

}  // namespace

std::string literal_regex(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x{%02X}", u);
      out += hex;
    } else {
      if (u < 0x80 && !ascii_alnum(u)) out += '\\';
      out += c;
    }
  }
  return out;
}

std::optional<std::string> literal_of_regex(std::string_view regex) {
  std::string text;
  for (size_t i = 0; i < regex.size(); ++i) {
    const auto u = static_cast<unsigned char>(regex[i]);
    if (u != '\\') {
      if (u < 0x80 && !ascii_alnum(u)) return std::nullopt;  // an operator
      text += regex[i];
      continue;
    }
    if (i + 1 == regex.size()) return std::nullopt;
    const auto next = static_cast<unsigned char>(regex[i + 1]);
    const auto hex = [&](size_t at) {
      return std::isxdigit(static_cast<unsigned char>(regex[at]));
    };
    if (regex.substr(i, 3) == "\\x{" && i + 5 < regex.size() && regex[i + 5] == '}' && hex(i + 3) &&
        hex(i + 4)) {  // \x{HH}: a control character
      text += static_cast<char>(std::stoi(std::string(regex.substr(i + 3, 2)), nullptr, 16));
      i += 5;
    } else if (next >= 0x20 && next < 0x7f && !ascii_alnum(next)) {
      text += static_cast<char>(next);
      ++i;
    } else {
      return std::nullopt;  // a class (\d, \w) or another escape
    }
  }
  return text;
}

std::string_view known_pattern_regex(KnownPattern pattern) {
  switch (pattern) {
    case KnownPattern::kGpt2:
      return kGpt2Regex;
    case KnownPattern::kCl100k:
      return kCl100kRegex;
    case KnownPattern::kO200k:
      return kO200kRegex;
    case KnownPattern::kQwen2:
      return kQwen2Regex;
  }
  POLLEN_ASSERT(false);
}

std::string_view known_pattern_name(KnownPattern pattern) {
  switch (pattern) {
    case KnownPattern::kGpt2:
      return "gpt2";
    case KnownPattern::kCl100k:
      return "cl100k_base";
    case KnownPattern::kO200k:
      return "o200k_base";
    case KnownPattern::kQwen2:
      return "qwen2";
  }
  POLLEN_ASSERT(false);
}

std::optional<KnownPattern> known_pattern_named(std::string_view name) {
  if (name == "gpt2" || name == "r50k_base") return KnownPattern::kGpt2;
  if (name == "cl100k_base") return KnownPattern::kCl100k;
  if (name == "o200k_base") return KnownPattern::kO200k;
  if (name == "qwen2") return KnownPattern::kQwen2;
  return std::nullopt;
}

std::optional<KnownPattern> recognise_pattern(std::string_view regex) {
  for (auto p :
       {KnownPattern::kGpt2, KnownPattern::kCl100k, KnownPattern::kO200k, KnownPattern::kQwen2})
    if (regex == known_pattern_regex(p)) return p;
  return std::nullopt;
}

std::string describe_pattern(std::string_view regex) {
  if (auto known = recognise_pattern(regex)) return std::string(known_pattern_name(*known));
  return "'" + std::string(regex.substr(0, 60)) + (regex.size() > 60 ? "...'" : "'");
}

size_t known_pattern_match(KnownPattern pattern, const unsigned char* p, const unsigned char* end) {
  switch (pattern) {
    case KnownPattern::kGpt2:
      return match_gpt2(p, end);
    case KnownPattern::kCl100k:
      return match_cl100k(p, end, 3);
    case KnownPattern::kO200k:
      return match_o200k(p, end);
    case KnownPattern::kQwen2:
      return match_cl100k(p, end, 1);
  }
  POLLEN_ASSERT(false);
}

// ICU's regex engine over UTF-8 text, for patterns without a hand-written matcher.
class IcuRegex {
 public:
  explicit IcuRegex(const std::string& regex) {
    UErrorCode status = U_ZERO_ERROR;
    UParseError where{};
    pattern_.reset(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(icu_syntax(regex)), 0,
                                              where, status));
    POLLEN_CHECK(U_SUCCESS(status), "pre-tokenizer regex /", regex, "/ does not compile (",
                 u_errorName(status), " at offset ", where.offset, ")");
  }

  // Reports the matches as HF's regex engine (Oniguruma) iterates them: empty matches too,
  // except one at the end of the match before.
  void find_all(std::string_view text,
                const std::function<void(size_t begin, size_t end)>& on_match) const {
    UErrorCode status = U_ZERO_ERROR;
    UText* utext = utext_openUTF8(nullptr, text.data(), static_cast<int64_t>(text.size()), &status);
    std::unique_ptr<icu::RegexMatcher> matcher(pattern_->matcher(status));
    POLLEN_CHECK(U_SUCCESS(status), "ICU regex: ", u_errorName(status));
    matcher->reset(utext);
    int64_t last_end = -1;
    while (matcher->find(status) && U_SUCCESS(status)) {
      int64_t b = matcher->start64(status), e = matcher->end64(status);
      if (e == b && b == last_end) continue;
      on_match(static_cast<size_t>(b), static_cast<size_t>(e));
      last_end = e;
    }
    utext_close(utext);
    POLLEN_CHECK(U_SUCCESS(status), "ICU regex: ", u_errorName(status));
  }

 private:
  // The classes as HF's engine (Oniguruma) defines them, in ICU's syntax:
  // - ICU's \s is [\t\n\f\r\p{Z}]; Oniguruma's is White_Space (which adds \v and U+0085).
  // - ICU's \w is Alphabetic, marks, decimal digits, connectors and the joiners U+200C/D;
  //   Oniguruma's lacks the joiners, and outside a class it also takes Latin-1's superscripts
  //   and fractions (U+00B2, B3, B9, BC-BE: its single-byte table's). \W and the boundaries \b
  //   and \B follow \w (as lookarounds, where ICU's \b has rules of its own); in a class \b
  //   is a backspace.
  // - Oniguruma's \h and \H are a hex digit and not one; ICU's are horizontal space.
  static std::string icu_syntax(const std::string& regex) {
    static const std::string unicode_word = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}";
    static const std::string latin1_extra = "\\u00B2\\u00B3\\u00B9\\u00BC-\\u00BE";
    static const std::string word = "[" + unicode_word + latin1_extra + "]";
    static const std::string boundary =
        "(?:(?<=" + word + ")(?!" + word + ")|(?<!" + word + ")(?=" + word + "))";
    static const std::string inside =
        "(?:(?<=" + word + ")(?=" + word + ")|(?<!" + word + ")(?!" + word + "))";
    std::string out;
    int in_class = 0;        // depth of [...] sets
    size_t class_items = 0;  // where the innermost set's items begin in `regex`
    // A class escape in a set. A '-' just before it is a literal to Oniguruma ([\s-\w]) but a
    // range, or before a nested set a difference, to ICU: it is escaped.
    const auto set_item = [&](const std::string& text) {
      const size_t n = out.size();
      if (in_class > 0 && n >= 2 && out[n - 1] == '-' && out[n - 2] != '\\' && out[n - 2] != '[' &&
          out[n - 2] != '^')
        out.insert(n - 1, "\\");
      out += text;
    };
    for (size_t i = 0; i < regex.size(); ++i) {
      if (regex[i] == '\\' && i + 1 < regex.size()) {
        const char next = regex[i + 1];
        const std::string& extra = in_class > 0 ? std::string() : latin1_extra;
        if (next == 's')
          set_item("\\p{White_Space}");
        else if (next == 'S')
          set_item("\\P{White_Space}");
        else if (next == 'w')
          set_item("[" + unicode_word + extra + "]");
        else if (next == 'W')
          set_item("[^" + unicode_word + extra + "]");
        else if (next == 'b')
          out += in_class > 0 ? "\\x08" : boundary;
        else if (next == 'B' && in_class == 0)
          out += inside;
        else if (next == 'h')  // Oniguruma's hex digit (ICU's \h is horizontal space)
          set_item("[0-9A-Fa-f]");
        else if (next == 'H')
          set_item("[^0-9A-Fa-f]");
        else
          out += regex.substr(i, 2);
        ++i;
      } else if (regex[i] == '[') {
        ++in_class;
        class_items = i + 1 < regex.size() && regex[i + 1] == '^' ? i + 2 : i + 1;
        out += regex[i];
      } else if (regex[i] == ']' && in_class > 0 && i == class_items) {
        out += "\\]";  // a set's first item: a literal ']' ([]a] in Oniguruma)
      } else {
        if (regex[i] == ']' && in_class > 0) --in_class;
        out += regex[i];
      }
    }
    return out;
  }

  std::unique_ptr<icu::RegexPattern> pattern_;
};

PatternSplitter::PatternSplitter(std::string regex)
    : regex_(std::move(regex)), known_(recognise_pattern(regex_)) {
  if (!known_) icu_ = std::make_unique<IcuRegex>(regex_);
}
PatternSplitter::~PatternSplitter() = default;
PatternSplitter::PatternSplitter(PatternSplitter&&) noexcept = default;
PatternSplitter& PatternSplitter::operator=(PatternSplitter&&) noexcept = default;

void PatternSplitter::split(std::string_view text, const Sink& sink) const {
  while (!text.empty()) {
    size_t valid = valid_utf8_prefix(text);
    if (valid > 0) split_valid(text.substr(0, valid), sink);
    if (valid < text.size()) sink(text.substr(valid, 1), true);
    text.remove_prefix(std::min(text.size(), valid + 1));
  }
}

void PatternSplitter::split_valid(std::string_view text, const Sink& sink) const {
  if (known_) {
    auto* p = reinterpret_cast<const Byte*>(text.data());
    auto* end = p + text.size();
    while (p < end) {
      size_t n = known_pattern_match(*known_, p, end);
      sink(std::string_view(reinterpret_cast<const char*>(p), n), true);
      p += n;
    }
    return;
  }
  size_t done = 0;
  icu_->find_all(text, [&](size_t b, size_t e) {
    if (b > done) sink(text.substr(done, b - done), false);
    sink(text.substr(b, e - b), true);
    done = e;
  });
  if (done < text.size()) sink(text.substr(done), false);
}

}  // namespace pollen::tokenizer
