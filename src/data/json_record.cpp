#include "data/json_record.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/unicode.h"

namespace pollen::data {
namespace {

constexpr uint64_t kOnes = 0x0101010101010101ull;
constexpr uint64_t kHighs = 0x8080808080808080ull;

// True when some byte of v is below n (n <= 128).
inline bool any_below(uint64_t v, uint64_t n) {
  return ((v - kOnes * n) & ~v & kHighs) != 0;
}
inline bool any_equal(uint64_t v, uint64_t c) {
  return any_below(v ^ (kOnes * c), 1);
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') return (c | 0x20) - 'a' + 10;
  return -1;
}

class Scanner {
 public:
  explicit Scanner(std::string_view s)
      : begin_(s.data()), p_(s.data()), end_(s.data() + s.size()) {}

  void skip_ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  bool at_end() const { return p_ == end_; }
  bool peek(char c) const { return p_ < end_ && *p_ == c; }
  bool take(char c) {
    if (!peek(c)) return false;
    ++p_;
    return true;
  }
  bool expect(char c, const char* what) {
    skip_ws();
    if (take(c)) return true;
    return error(what);
  }
  bool error(const char* what) {
    if (error_.empty()) {
      error_ = "invalid JSON at byte " + std::to_string(p_ - begin_ + 1) + ": " + what;
    }
    return false;
  }
  const std::string& error_text() const { return error_; }
  const char* pos() const { return p_; }

  // A string starting at '"'. With `out`, its decoded value is appended; `raw` receives the
  // bytes between the quotes when no escape occurs in them (else it is left empty and
  // `escaped` set).
  bool string(std::string* out, std::string_view* raw = nullptr, bool* escaped = nullptr) {
    if (!take('"')) return error("expected a string");
    const char* run = p_;
    bool any_escape = false;
    while (true) {
#ifdef __AVX2__
      // 32 bytes at a time up to the first '"', '\\' or control character.
      while (end_ - p_ >= 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p_));
        const __m256i stop =
            _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi8('"')),
                                            _mm256_cmpeq_epi8(v, _mm256_set1_epi8('\\'))),
                            _mm256_cmpeq_epi8(_mm256_min_epu8(v, _mm256_set1_epi8(0x1f)), v));
        if (const auto m = static_cast<uint32_t>(_mm256_movemask_epi8(stop))) {
          p_ += __builtin_ctz(m);
          break;
        }
        p_ += 32;
      }
#endif
      // Eight bytes at a time while none is '"', '\\' or a control character.
      while (end_ - p_ >= 8) {
        uint64_t v;
        std::memcpy(&v, p_, 8);
        if (any_equal(v, '"') || any_equal(v, '\\') || any_below(v, 0x20)) break;
        p_ += 8;
      }
      if (p_ == end_) return error("unterminated string");
      unsigned char c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        if (out) out->append(run, static_cast<size_t>(p_ - run));
        if (raw && !any_escape) *raw = std::string_view(run, static_cast<size_t>(p_ - run));
        if (escaped) *escaped = any_escape;
        ++p_;
        return true;
      }
      if (c < 0x20) return error("control character in a string (escape it)");
      if (c != '\\') {
        ++p_;
        continue;
      }
      any_escape = true;
      if (out) out->append(run, static_cast<size_t>(p_ - run));
      if (end_ - p_ < 2) return error("unterminated escape");
      char e = p_[1];
      p_ += 2;
      char simple = 0;
      switch (e) {
        case '"':
          simple = '"';
          break;
        case '\\':
          simple = '\\';
          break;
        case '/':
          simple = '/';
          break;
        case 'b':
          simple = '\b';
          break;
        case 'f':
          simple = '\f';
          break;
        case 'n':
          simple = '\n';
          break;
        case 'r':
          simple = '\r';
          break;
        case 't':
          simple = '\t';
          break;
        case 'u':
          break;
        default:
          p_ -= 1;
          return error("unknown escape");
      }
      if (simple) {
        if (out) *out += simple;
      } else {
        uint32_t cp = 0;
        if (!hex4(cp)) return false;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return error("lone low surrogate in \\u escape");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u')
            return error("high surrogate not followed by a low surrogate");
          p_ += 2;
          uint32_t lo = 0;
          if (!hex4(lo)) return false;
          if (lo < 0xDC00 || lo > 0xDFFF)
            return error("high surrogate not followed by a low surrogate");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        if (out) tokenizer::append_utf8(*out, static_cast<char32_t>(cp));
      }
      run = p_;
    }
  }

  // A number per the JSON grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  bool number() {
    auto digit = [&] { return p_ < end_ && *p_ >= '0' && *p_ <= '9'; };
    take('-');
    if (take('0')) {
    } else if (digit()) {
      while (digit()) ++p_;
    } else {
      return error("invalid number");
    }
    if (take('.')) {
      if (!digit()) return error("invalid number: digits expected after '.'");
      while (digit()) ++p_;
    }
    if (peek('e') || peek('E')) {
      ++p_;
      if (!take('+')) take('-');
      if (!digit()) return error("invalid number: digits expected in the exponent");
      while (digit()) ++p_;
    }
    return true;
  }

  bool literal(const char* word) {
    size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n) != 0)
      return error("expected a value");
    p_ += n;
    return true;
  }

  // One value of any kind, checked and skipped; nesting is kept on an explicit stack, so any
  // depth is fine.
  bool skip_value() {
    stack_.clear();
    while (true) {
      skip_ws();
      if (p_ == end_) return error("expected a value");
      const char c = *p_;
      if (c == '{' || c == '[') {
        ++p_;
        skip_ws();
        if (!take(c == '{' ? '}' : ']')) {
          stack_.push_back(c);
          if (c == '{' && !member_key()) return false;
          continue;  // the first element
        }
      } else if (!scalar(c)) {
        return false;
      }
      // After a value: close finished containers, or go on to the next element.
      while (true) {
        if (stack_.empty()) return true;
        skip_ws();
        const char top = stack_.back();
        if (take(',')) {
          if (top == '{' && !member_key()) return false;
          break;
        }
        if (!take(top == '{' ? '}' : ']'))
          return error(top == '{' ? "expected ',' or '}'" : "expected ',' or ']'");
        stack_.pop_back();
      }
    }
  }

  bool scalar(char c) {
    if (c == '"') return string(nullptr);
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    if (c == 't') return literal("true");
    if (c == 'f') return literal("false");
    if (c == 'n') return literal("null");
    return error("expected a value");
  }

  // A member's key and the ':' after it.
  bool member_key() {
    skip_ws();
    if (!peek('"')) return error("expected a key string");
    if (!string(nullptr)) return false;
    return expect(':', "expected ':'");
  }

 private:
  bool hex4(uint32_t& cp) {
    if (end_ - p_ < 4) return error("truncated \\u escape");
    cp = 0;
    for (int k = 0; k < 4; ++k) {
      int h = hex_value(p_[k]);
      if (h < 0) return error("invalid hex digit in \\u escape");
      cp = cp * 16 + static_cast<uint32_t>(h);
    }
    p_ += 4;
    return true;
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  std::string error_;
  std::vector<char> stack_;
};

}  // namespace

std::string parse_record(std::string_view line, std::string_view text_field,
                         std::string_view id_field, RecordFields& out) {
  out.text.clear();
  out.id.clear();
  out.has_text = out.has_id = false;
  Scanner s(line);
  std::string key;
  s.skip_ws();
  if (!s.take('{')) {
    s.error("expected a JSON object");
    return s.error_text();
  }
  s.skip_ws();
  if (!s.take('}')) {
    while (true) {
      s.skip_ws();
      if (!s.peek('"')) {
        s.error("expected a key string");
        return s.error_text();
      }
      std::string_view raw;
      bool escaped = false;
      key.clear();
      if (!s.string(&key, &raw, &escaped)) return s.error_text();
      std::string_view k = escaped ? std::string_view(key) : raw;
      const bool is_text = k == text_field;
      const bool is_id = !id_field.empty() && k == id_field;
      if (!s.expect(':', "expected ':'")) return s.error_text();
      s.skip_ws();
      if ((is_text || is_id) && s.peek('"')) {
        std::string& dst = is_text ? out.text : out.id;
        dst.clear();
        if (!s.string(&dst)) return s.error_text();
        if (is_text) out.has_text = true;
        if (is_id) {
          if (is_text) out.id = out.text;
          out.has_id = !out.id.empty();  // an empty id names nothing: file:line instead
        }
      } else {
        const char* start = s.pos();
        if (!s.skip_value()) return s.error_text();
        bool number = *start == '-' || (*start >= '0' && *start <= '9');
        if (is_text) out.has_text = false;
        if (is_id) {
          // A numeric id is written as nlohmann writes the number.
          out.has_id = number;
          out.id.clear();
          if (number) {
            std::string_view text(start, static_cast<size_t>(s.pos() - start));
            auto j = nlohmann::json::parse(text, nullptr, false);
            out.id = j.is_discarded() ? std::string(text) : j.dump();
          }
        }
      }
      s.skip_ws();
      if (s.take(',')) continue;
      if (s.take('}')) break;
      s.error("expected ',' or '}'");
      return s.error_text();
    }
  }
  s.skip_ws();
  if (!s.at_end()) {
    s.error("unexpected data after the object");
    return s.error_text();
  }
  return {};
}

// A JSON string literal, written directly (nlohmann's serializer goes byte by byte).
void append_json_string(std::string& out, std::string_view v) {
  static const char* hex = "0123456789abcdef";
  out += '"';
  size_t run = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    // Eight bytes at a time while none needs escaping.
    while (v.size() - i >= 8) {
      uint64_t w;
      std::memcpy(&w, v.data() + i, 8);
      if (any_equal(w, '"') || any_equal(w, '\\') || any_below(w, 0x20)) break;
      i += 8;
    }
    if (i == v.size()) break;
    unsigned char c = static_cast<unsigned char>(v[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(v.data() + run, i - run);
    run = i + 1;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        out += "\\u00";
        out += hex[c >> 4];
        out += hex[c & 15];
    }
  }
  out.append(v.data() + run, v.size() - run);
  out += '"';
}

}  // namespace pollen::data
