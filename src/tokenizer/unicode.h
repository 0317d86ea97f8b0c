#pragma once
// Unicode helpers for pre-tokenisation: UTF-8 decoding, the character classes the GPT-style
// patterns use (from ICU's Unicode data), and NFC normalisation.
#include <cstdint>
#include <string>
#include <string_view>

namespace pollen::tokenizer {

// Character classes, as bit flags. A code point's flags are looked up in a table built once from
// ICU's general categories and White_Space property.
enum CharClass : uint8_t {
  kLetter = 1 << 0,     // \p{L}
  kNumber = 1 << 1,     // \p{N}
  kSpace = 1 << 2,      // \s (White_Space)
  kUpperLike = 1 << 3,  // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]   (o200k's "upper" run)
  kLowerLike = 1 << 4,  // [\p{Ll}\p{Lm}\p{Lo}\p{M}]         (o200k's "lower" run)
  kLineBreak = 1 << 5,  // \r or \n
};

uint8_t char_class(char32_t cp);

// One decoded code point: its value and its length in bytes. length 0 means the bytes at that
// position are not valid UTF-8 (a stray continuation byte, an overlong or truncated sequence,
// a surrogate, or a value above U+10FFFF).
struct Decoded {
  char32_t cp;
  int length;
};

inline Decoded decode_utf8(const unsigned char* p, const unsigned char* end) {
  unsigned char b0 = p[0];
  if (b0 < 0x80) return {b0, 1};
  auto cont = [&](int i) { return p + i < end && (p[i] & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (!cont(1)) return {0, 0};
    return {char32_t((b0 & 0x1F) << 6 | (p[1] & 0x3F)), 2};
  }
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (!cont(1) || !cont(2)) return {0, 0};
    char32_t cp = (b0 & 0x0F) << 12 | (p[1] & 0x3F) << 6 | (p[2] & 0x3F);
    if (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF)) return {0, 0};
    return {cp, 3};
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return {0, 0};
    char32_t cp = (b0 & 0x07) << 18 | (p[1] & 0x3F) << 12 | (p[2] & 0x3F) << 6 | (p[3] & 0x3F);
    if (cp < 0x10000 || cp > 0x10FFFF) return {0, 0};
    return {cp, 4};
  }
  return {0, 0};
}

// Length of the longest prefix of `text` that is valid UTF-8.
size_t valid_utf8_prefix(std::string_view text);

void append_utf8(std::string& out, char32_t cp);

// NFC normalisation. Valid UTF-8 runs are normalised; bytes that are not valid UTF-8 are kept
// as they are, in place.
std::string nfc(std::string_view text);

}  // namespace pollen::tokenizer
