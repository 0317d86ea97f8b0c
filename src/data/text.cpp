#include "data/text.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <array>

#include "base/hash.h"

namespace pollen::data {
namespace {

inline bool is_space(unsigned char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

}  // namespace

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

namespace {
// Bit j set when byte j of the 64 at p is whitespace.
inline uint64_t space_mask64(const char* p) {
#ifdef __AVX2__
  uint64_t m = 0;
  for (int half = 0; half < 2; ++half) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
    // ' ' or '\t'..'\r' (9..13): space, tab, LF, VT, FF, CR.
    __m256i sp = _mm256_cmpeq_epi8(v, _mm256_set1_epi8(' '));
    __m256i ctl = _mm256_cmpeq_epi8(
        _mm256_min_epu8(_mm256_sub_epi8(v, _mm256_set1_epi8(9)), _mm256_set1_epi8(4)),
        _mm256_sub_epi8(v, _mm256_set1_epi8(9)));
    auto bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_or_si256(sp, ctl)));
    m |= static_cast<uint64_t>(bits) << (32 * half);
  }
  return m;
#else
  uint64_t m = 0;
  for (int j = 0; j < 64; ++j)
    m |= static_cast<uint64_t>(is_space(static_cast<unsigned char>(p[j]))) << j;
  return m;
#endif
}
}  // namespace

void split_words(std::string_view s, std::vector<std::string_view>& out) {
  out.clear();
  const size_t n = s.size();
  size_t i = 0, start = 0;
  bool in_word = false;
  // 64 bytes at a time: word starts and ends are the 0->1 and 1->0 steps of the non-space bits.
  uint64_t prev_space = 1;  // the byte before the text counts as a space
  for (; i + 64 <= n; i += 64) {
    const uint64_t sp = space_mask64(s.data() + i);
    const uint64_t before = (sp << 1) | prev_space;  // bit j: byte j-1 is a space
    uint64_t edges = sp ^ before;
    prev_space = sp >> 63;
    while (edges) {
      const size_t j = i + static_cast<size_t>(__builtin_ctzll(edges));
      edges &= edges - 1;
      if (!in_word) {
        start = j;
      } else {
        out.push_back(s.substr(start, j - start));
      }
      in_word = !in_word;
    }
  }
  for (; i < n; ++i) {
    const bool space = is_space(static_cast<unsigned char>(s[i]));
    if (in_word && space) {
      out.push_back(s.substr(start, i - start));
      in_word = false;
    } else if (!in_word && !space) {
      start = i;
      in_word = true;
    }
  }
  if (in_word) out.push_back(s.substr(start, n - start));
}

void split_lines(std::string_view s, std::vector<std::string_view>& out) {
  out.clear();
  size_t b = 0;
  while (b < s.size()) {
    size_t e = s.find('\n', b);
    if (e == std::string_view::npos) e = s.size();
    out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
}

std::string_view strip(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && is_space(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

void normalized_word_hashes(std::string_view s, uint64_t seed, std::vector<uint64_t>& out) {
  // kNorm[c]: the byte a word keeps for c (lower-cased), 0 when c is dropped (ASCII punctuation
  // and controls).
  static const auto kNorm = [] {
    std::array<unsigned char, 256> t{};
    for (int c = 0; c < 256; ++c)
      t[static_cast<size_t>(c)] = c >= 0x80 || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z')
                                      ? static_cast<unsigned char>(c)
                                  : (c >= 'A' && c <= 'Z') ? static_cast<unsigned char>(c + 32)
                                                           : 0;
    return t;
  }();
  thread_local std::vector<std::string_view> words;
  thread_local std::string w;
  split_words(s, words);
  out.clear();
  for (std::string_view word : words) {
    bool plain = true;  // already normalised: hash it where it is
    for (char c : word) {
      auto u = static_cast<unsigned char>(c);
      plain &= u != 0 && kNorm[u] == u;
    }
    if (plain) {
      out.push_back(xxh64(word.data(), word.size(), seed));
      continue;
    }
    w.resize(word.size());
    size_t k = 0;
    for (char c : word) {
      unsigned char v = kNorm[static_cast<unsigned char>(c)];
      w[k] = static_cast<char>(v);
      k += v != 0;
    }
    if (k > 0) out.push_back(xxh64(w.data(), k, seed));
  }
}

}  // namespace pollen::data
