#include "base/utf8.h"

#include <cstdint>

namespace pollen {
namespace {

// Length of the valid UTF-8 sequence at p, or 0 if invalid.
inline size_t utf8_seq(const unsigned char* p, const unsigned char* end) {
  unsigned c = p[0];
  if (c < 0x80) return 1;
  size_t avail = static_cast<size_t>(end - p);
  if (c >= 0xC2 && c <= 0xDF) return (avail >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (avail < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && p[1] < 0xA0) return 0;   // overlong
    if (c == 0xED && p[1] >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (avail < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80)
      return 0;
    if (c == 0xF0 && p[1] < 0x90) return 0;
    if (c == 0xF4 && p[1] >= 0x90) return 0;
    return 4;
  }
  return 0;
}

// Length of the maximal prefix of an invalid sequence at p (at least 1), per the Unicode
// "substitution of maximal subparts" practice.
inline size_t invalid_len(const unsigned char* p, const unsigned char* end) {
  unsigned c = p[0];
  size_t need = 0;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF)
    need = 1;
  else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 1;
  }
  size_t n = 1;
  for (size_t k = 0; k < need && p + n < end; ++k) {
    unsigned b = p[n];
    if (b < lo || b > hi) break;
    lo = 0x80;
    hi = 0xBF;
    ++n;
  }
  return n;
}

}  // namespace

bool utf8_valid(std::string_view s) {
  return utf8_invalid_at(s) == std::string_view::npos;
}

size_t utf8_invalid_at(std::string_view s) {
  auto* begin = reinterpret_cast<const unsigned char*>(s.data());
  auto* p = begin;
  auto* end = p + s.size();
  while (p < end) {
    // Fast path over ASCII, eight bytes at a time.
    while (end - p >= 8) {
      uint64_t v;
      __builtin_memcpy(&v, p, 8);
      if (v & 0x8080808080808080ull) break;
      p += 8;
    }
    if (p >= end) break;
    size_t n = utf8_seq(p, end);
    if (n == 0) return static_cast<size_t>(p - begin);
    p += n;
  }
  return std::string_view::npos;
}

size_t utf8_repair(std::string_view s, std::string& out) {
  out.clear();
  out.reserve(s.size());
  size_t repairs = 0;
  auto* p = reinterpret_cast<const unsigned char*>(s.data());
  auto* end = p + s.size();
  while (p < end) {
    size_t n = utf8_seq(p, end);
    if (n) {
      out.append(reinterpret_cast<const char*>(p), n);
      p += n;
    } else {
      out += "\xEF\xBF\xBD";
      ++repairs;
      p += invalid_len(p, end);
    }
  }
  return repairs;
}

}  // namespace pollen
