#include "tokenizer/unicode.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <array>
#include <map>
#include <memory>
#include <vector>

#include "base/error.h"

namespace pollen::tokenizer {
namespace {

constexpr char32_t kCodePoints = 0x110000;
constexpr int kBlockBits = 8;
constexpr int kBlockSize = 1 << kBlockBits;

uint8_t class_from_icu(char32_t cp) {
  uint8_t flags = 0;
  int8_t type = u_charType(static_cast<UChar32>(cp));
  bool lu = type == U_UPPERCASE_LETTER, ll = type == U_LOWERCASE_LETTER,
       lt = type == U_TITLECASE_LETTER, lm = type == U_MODIFIER_LETTER, lo = type == U_OTHER_LETTER;
  bool mark =
      type == U_NON_SPACING_MARK || type == U_ENCLOSING_MARK || type == U_COMBINING_SPACING_MARK;
  bool number = type == U_DECIMAL_DIGIT_NUMBER || type == U_LETTER_NUMBER || type == U_OTHER_NUMBER;
  if (lu || ll || lt || lm || lo) flags |= kLetter;
  if (number) flags |= kNumber;
  if (u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE)) flags |= kSpace;
  if (lu || lt || lm || lo || mark) flags |= kUpperLike;
  if (ll || lm || lo || mark) flags |= kLowerLike;
  if (cp == '\r' || cp == '\n') flags |= kLineBreak;
  return flags;
}

// A two-level table: block index per 256 code points, blocks deduplicated (about 40 KB).
struct ClassTable {
  std::vector<uint16_t> block_of;
  std::vector<uint8_t> blocks;

  ClassTable() {
    block_of.resize(kCodePoints >> kBlockBits);
    std::map<std::array<uint8_t, kBlockSize>, uint16_t> seen;
    for (char32_t b = 0; b < (kCodePoints >> kBlockBits); ++b) {
      std::array<uint8_t, kBlockSize> block;
      for (int i = 0; i < kBlockSize; ++i) block[i] = class_from_icu((b << kBlockBits) | i);
      auto [it, inserted] = seen.emplace(block, static_cast<uint16_t>(seen.size()));
      if (inserted) blocks.insert(blocks.end(), block.begin(), block.end());
      block_of[b] = it->second;
    }
  }
};

const ClassTable& class_table() {
  static const ClassTable table;
  return table;
}

}  // namespace

uint8_t char_class(char32_t cp) {
  const ClassTable& t = class_table();
  return t.blocks[(size_t(t.block_of[cp >> kBlockBits]) << kBlockBits) | (cp & (kBlockSize - 1))];
}

size_t valid_utf8_prefix(std::string_view text) {
  auto* p = reinterpret_cast<const unsigned char*>(text.data());
  auto* end = p + text.size();
  const unsigned char* start = p;
  while (p < end) {
    if (*p < 0x80) {
      ++p;
      continue;
    }
    Decoded d = decode_utf8(p, end);
    if (d.length == 0) break;
    p += d.length;
  }
  return static_cast<size_t>(p - start);
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

namespace {

const icu::Normalizer2& nfc_instance() {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
  POLLEN_CHECK(U_SUCCESS(status) && n,
               "ICU: cannot load the NFC normaliser: ", u_errorName(status));
  return *n;
}

void nfc_valid(std::string_view text, std::string& out) {
  bool ascii = true;
  for (unsigned char c : text) ascii &= c < 0x80;
  if (ascii) {
    out.append(text);
    return;
  }
  const icu::Normalizer2& n = nfc_instance();
  UErrorCode status = U_ZERO_ERROR;
  icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  if (n.isNormalizedUTF8(piece, status) && U_SUCCESS(status)) {
    out.append(text);
    return;
  }
  status = U_ZERO_ERROR;
  icu::StringByteSink<std::string> sink(&out);
  n.normalizeUTF8(0, piece, sink, nullptr, status);
  POLLEN_CHECK(U_SUCCESS(status), "ICU: NFC normalisation failed: ", u_errorName(status));
}

}  // namespace

std::string nfc(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    size_t valid = valid_utf8_prefix(text);
    nfc_valid(text.substr(0, valid), out);
    if (valid < text.size()) out += text[valid++];
    text.remove_prefix(valid);
  }
  return out;
}

}  // namespace pollen::tokenizer
