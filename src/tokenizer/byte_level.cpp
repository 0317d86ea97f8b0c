#include "tokenizer/byte_level.h"

#include <array>
#include <unordered_map>

#include "tokenizer/unicode.h"

namespace pollen::tokenizer {
namespace {

// Printable bytes stand for themselves; the others are numbered from U+0100 in byte order.
const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

const std::unordered_map<char32_t, unsigned char>& char_to_byte() {
  static const std::unordered_map<char32_t, unsigned char> map = [] {
    std::unordered_map<char32_t, unsigned char> m;
    for (int b = 0; b < 256; ++b) m[byte_to_char()[b]] = static_cast<unsigned char>(b);
    return m;
  }();
  return map;
}

}  // namespace

char32_t byte_level_char(unsigned char byte) {
  return byte_to_char()[byte];
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) append_utf8(out, byte_to_char()[b]);
  return out;
}

std::optional<std::string> byte_level_to_bytes(std::string_view text) {
  std::string out;
  auto* p = reinterpret_cast<const unsigned char*>(text.data());
  auto* end = p + text.size();
  while (p < end) {
    Decoded d = decode_utf8(p, end);
    if (d.length == 0) return std::nullopt;
    auto it = char_to_byte().find(d.cp);
    if (it == char_to_byte().end()) return std::nullopt;
    out += static_cast<char>(it->second);
    p += d.length;
  }
  return out;
}

}  // namespace pollen::tokenizer
