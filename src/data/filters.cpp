#include "data/filters.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "base/config.h"
#include "base/error.h"
#include "base/hash.h"
#include "data/text.h"

namespace pollen::data {
namespace {

bool is_punct(unsigned char c) {
  return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') ||
         (c >= '{' && c <= '~');
}
size_t count_sub(std::string_view s, std::string_view sub) {
  size_t n = 0;
  for (size_t p = s.find(sub); p != std::string_view::npos; p = s.find(sub, p + sub.size())) ++n;
  return n;
}
bool ends_with(std::string_view s, std::string_view e) {
  return s.size() >= e.size() && s.substr(s.size() - e.size()) == e;
}
bool starts_with(std::string_view s, std::string_view e) {
  return s.substr(0, e.size()) == e;
}

// Counts of 64-bit hashes (open addressing, linear probing), reused from document to document
// so that counting n-grams allocates nothing once warm. Each entry also keeps where its key was
// first seen.
class HashCounter {
 public:
  struct Entry {
    uint64_t key;  // 0: empty (a key of 0 is stored as 1)
    uint32_t count, first;
  };
  void reset(size_t expected) {
    size_t cap = 16;
    while (cap < 2 * expected) cap *= 2;
    table_.assign(cap, Entry{0, 0, 0});
    mask_ = cap - 1;
  }
  // The entry of `key`, added with count 0 at position `at` when new.
  Entry* entries() { return table_.data(); }
  Entry& find(uint64_t key, uint32_t at) {
    key |= key == 0;
    size_t i = (key ^ (key >> 29)) & mask_;
    while (table_[i].key != 0 && table_[i].key != key) i = (i + 1) & mask_;
    Entry& e = table_[i];
    if (e.key == 0) e = Entry{key, 0, at};
    return e;
  }

 private:
  std::vector<Entry> table_;
  size_t mask_ = 0;
};

// (duplicate elements, their total bytes): elements seen before, as datatrove counts them.
std::pair<size_t, size_t> find_duplicates(const std::vector<std::string_view>& xs) {
  thread_local HashCounter seen;
  seen.reset(xs.size());
  size_t n = 0, chars = 0;
  for (auto x : xs)
    if (seen.find(xxh64(x.data(), x.size(), 3), 0).count++ > 0) {
      ++n;
      chars += x.size();
    }
  return {n, chars};
}

// A word's 64-bit hash, inline: words of up to 16 bytes are read as two (overlapping) words
// and mixed by multiplies; longer ones go to xxh64.
inline uint64_t word_hash(std::string_view w) {
  const size_t n = w.size();
  if (n > 16) return xxh64(w.data(), n, n);
  uint64_t a = 0, b = 0;
  if (n >= 8) {
    std::memcpy(&a, w.data(), 8);
    std::memcpy(&b, w.data() + n - 8, 8);
  } else if (n >= 4) {
    uint32_t x, y;
    std::memcpy(&x, w.data(), 4);
    std::memcpy(&y, w.data() + n - 4, 4);
    a = x;
    b = y;
  } else if (n > 0) {
    a = static_cast<unsigned char>(w[0]) |
        (static_cast<uint64_t>(static_cast<unsigned char>(w[n / 2])) << 8) |
        (static_cast<uint64_t>(static_cast<unsigned char>(w[n - 1])) << 16);
  }
  uint64_t h = a * 0x9e3779b97f4a7c15ull ^
               ((b * 0xc2b2ae3d27d4eb4full) >> 31 | (b * 0xc2b2ae3d27d4eb4full) << 33) ^ n;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 29);
}

inline uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

// Paragraphs: text split on runs of two or more newlines (after stripping the text).
void split_paragraphs(std::string_view text, std::vector<std::string_view>& out) {
  out.clear();
  text = strip(text);
  size_t b = 0;
  while (true) {
    size_t e = text.find("\n\n", b);
    if (e == std::string_view::npos) {
      out.push_back(text.substr(b));
      return;
    }
    out.push_back(text.substr(b, e - b));
    b = e;
    while (b < text.size() && text[b] == '\n') ++b;
  }
}

}  // namespace

const char* LengthFilter::check(std::string_view text) const {
  int64_t n = static_cast<int64_t>(text.size());
  if (n < min_chars) return "too_short";
  if (max_chars > 0 && n > max_chars) return "too_long";
  if (min_words > 0 || max_words > 0) {
    thread_local std::vector<std::string_view> w;
    split_words(text, w);
    int64_t nw = static_cast<int64_t>(w.size());
    if (nw < min_words) return "too_few_words";
    if (max_words > 0 && nw > max_words) return "too_many_words";
  }
  return nullptr;
}

namespace {
// Byte classes of the Gopher quality rules' word statistics.
enum : unsigned char { kSpace = 1, kNonPunct = 2, kAlpha = 4, kContinuation = 8 };
const std::array<unsigned char, 256> kByteClass = [] {
  std::array<unsigned char, 256> t{};
  for (int c = 0; c < 256; ++c) {
    auto u = static_cast<unsigned char>(c);
    unsigned char k = 0;
    if (c == ' ' || (c >= '\t' && c <= '\r')) k |= kSpace;
    if (!is_punct(u) && !(k & kSpace)) k |= kNonPunct;
    if (((c | 0x20) >= 'a' && (c | 0x20) <= 'z') || c >= 0x80) k |= kAlpha;
    if ((c & 0xC0) == 0x80) k |= kContinuation;
    t[static_cast<size_t>(c)] = k;
  }
  return t;
}();

// Bit j of each mask: the class of byte j of the 64 at p.
struct ClassMasks {
  uint64_t space = 0, non_punct = 0, alpha = 0, continuation = 0;
};
ClassMasks class_masks(const unsigned char* p) {
  ClassMasks m;
#ifdef __AVX2__
  for (int half = 0; half < 2; ++half) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
    auto in_range = [](__m256i x, char lo, char hi) {
      const __m256i d = _mm256_sub_epi8(x, _mm256_set1_epi8(lo));
      return _mm256_cmpeq_epi8(_mm256_min_epu8(d, _mm256_set1_epi8(static_cast<char>(hi - lo))), d);
    };
    const __m256i space =
        _mm256_or_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(' ')), in_range(v, '\t', '\r'));
    const __m256i punct =
        _mm256_or_si256(_mm256_or_si256(in_range(v, '!', '/'), in_range(v, ':', '@')),
                        _mm256_or_si256(in_range(v, '[', '`'), in_range(v, '{', '~')));
    const __m256i high = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);  // 0x80 and above
    const __m256i alpha =
        _mm256_or_si256(in_range(_mm256_or_si256(v, _mm256_set1_epi8(0x20)), 'a', 'z'), high);
    const __m256i continuation = _mm256_cmpgt_epi8(_mm256_set1_epi8(-64), v);  // 0x80..0xBF
    auto bits = [](__m256i x) {
      return static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(x)));
    };
    const int at = 32 * half;
    m.space |= bits(space) << at;
    m.non_punct |= (~bits(_mm256_or_si256(space, punct)) & 0xFFFFFFFFull) << at;
    m.alpha |= bits(alpha) << at;
    m.continuation |= bits(continuation) << at;
  }
#else
  for (int j = 0; j < 64; ++j) {
    const unsigned char k = kByteClass[p[j]];
    m.space |= static_cast<uint64_t>((k & kSpace) != 0) << j;
    m.non_punct |= static_cast<uint64_t>((k & kNonPunct) != 0) << j;
    m.alpha |= static_cast<uint64_t>((k & kAlpha) != 0) << j;
    m.continuation |= static_cast<uint64_t>((k & kContinuation) != 0) << j;
  }
#endif
  return m;
}

// Gopher's stop words, one bit each (0: not one), so that distinct ones are counted as datatrove's
// set intersection counts them.
unsigned stop_word_bit(std::string_view w) {
  switch (w.size()) {
    case 2:
      return w == "be" ? 1u : w == "to" ? 2u : w == "of" ? 4u : 0u;
    case 3:
      return w == "the" ? 8u : w == "and" ? 16u : 0u;
    case 4:
      return w == "that" ? 32u : w == "have" ? 64u : w == "with" ? 128u : 0u;
    default:
      return 0;
  }
}
}  // namespace

const char* GopherQualityFilter::check(std::string_view text) const {
  // One pass over the text, 64 bytes at a time: words (whitespace-separated runs) start and end
  // at the steps of the whitespace bits; the other class bits inside a word tell whether it
  // holds a byte that is not ASCII punctuation (a non-symbol word, whose characters count
  // towards the mean length), a letter, and how many UTF-8 continuation bytes.
  int64_t n_words_i = 0, non_symbol = 0, alpha = 0;
  unsigned stop_words_seen = 0;
  size_t non_symbol_len = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  bool in_word = false, word_non_punct = false, word_alpha = false;
  size_t word_start = 0, word_continuation = 0;
  auto end_word = [&](size_t end) {
    const size_t len = end - word_start;
    ++n_words_i;
    if (word_non_punct) {
      ++non_symbol;
      non_symbol_len += len - word_continuation;
    }
    alpha += word_alpha;
    if (min_stop_words > 0) stop_words_seen |= stop_word_bit(text.substr(word_start, len));
    in_word = false;
  };
  uint64_t prev_space = 1;  // the byte before the text counts as whitespace
  unsigned char tail[64];
  for (size_t i = 0; i < n; i += 64) {
    const unsigned char* block = p + i;
    if (n - i < 64) {  // the last bytes, followed by whitespace
      std::memset(tail, ' ', sizeof tail);
      std::memcpy(tail, p + i, n - i);
      block = tail;
    }
    const ClassMasks m = class_masks(block);
    uint64_t edges = m.space ^ ((m.space << 1) | prev_space);  // word starts and ends
    prev_space = m.space >> 63;
    unsigned from = 0;  // where the current word's bytes in this block begin
    auto take = [&](unsigned to) {
      const uint64_t bits = (to == 64 ? ~0ull : (1ull << to) - 1) & ~((1ull << from) - 1);
      word_non_punct |= (m.non_punct & bits) != 0;
      word_alpha |= (m.alpha & bits) != 0;
      word_continuation += static_cast<size_t>(__builtin_popcountll(m.continuation & bits));
    };
    while (edges) {
      const auto j = static_cast<unsigned>(__builtin_ctzll(edges));
      edges &= edges - 1;
      if (in_word) {
        take(j);
        end_word(i + j);
      } else {
        in_word = true;
        word_start = i + j;
        from = j;
        word_non_punct = word_alpha = false;
        word_continuation = 0;
      }
    }
    if (in_word) take(64);
  }
  if (in_word) end_word(n);
  const double n_words = static_cast<double>(n_words_i);
  if (min_doc_words > 0 && non_symbol < min_doc_words) return "gopher_too_few_words";
  if (max_doc_words > 0 && non_symbol > max_doc_words) return "gopher_too_many_words";
  if (non_symbol == 0) return "gopher_no_words";
  double avg = static_cast<double>(non_symbol_len) / static_cast<double>(non_symbol);
  // As in datatrove, a threshold of 0 turns its rule off (`if self.max_avg_word_length and
  // ...`): a maximum of 0 would otherwise drop nearly every document.
  if (min_avg_word_length > 0 && avg < min_avg_word_length) return "gopher_short_mean_word";
  if (max_avg_word_length > 0 && avg > max_avg_word_length) return "gopher_long_mean_word";
  if (max_symbol_word_ratio > 0) {
    if (static_cast<double>(count_sub(text, "#")) / n_words > max_symbol_word_ratio)
      return "gopher_hash_ratio";
    if (static_cast<double>(count_sub(text, "...") + count_sub(text, "\u2026")) / n_words >
        max_symbol_word_ratio)
      return "gopher_ellipsis_ratio";
  }
  // Lines split on '\n' (a trailing empty line is not one).
  size_t n_lines = 0, bullets = 0, ellipsis = 0;
  for (size_t b = 0; b < text.size();) {
    size_t e = text.find('\n', b);
    if (e == std::string_view::npos) e = text.size();
    auto s = strip(text.substr(b, e - b));
    ++n_lines;
    bullets += starts_with(s, "\u2022") || starts_with(s, "-");
    ellipsis += ends_with(s, "...") || ends_with(s, "\u2026");
    b = e + 1;
  }
  if (n_lines > 0) {
    double nl = static_cast<double>(n_lines);
    if (max_bullet_lines_ratio > 0 && static_cast<double>(bullets) / nl > max_bullet_lines_ratio)
      return "gopher_bullet_lines";
    if (max_ellipsis_lines_ratio > 0 &&
        static_cast<double>(ellipsis) / nl > max_ellipsis_lines_ratio)
      return "gopher_ellipsis_lines";
  }
  if (max_non_alpha_words_ratio > 0 &&
      static_cast<double>(alpha) / n_words < max_non_alpha_words_ratio)
    return "gopher_non_alpha_words";
  if (min_stop_words > 0 && std::popcount(stop_words_seen) < min_stop_words)
    return "gopher_few_stop_words";
  return nullptr;
}

const char* GopherRepetitionFilter::check(std::string_view text) const {
  if (text.empty()) return "repetition_empty";  // as datatrove's: no text is no document
  thread_local std::vector<std::string_view> parts, words;
  const double len = static_cast<double>(text.size());
  split_paragraphs(text, parts);
  auto [pd, pc] = find_duplicates(parts);
  if (dup_para_frac > 0 &&
      static_cast<double>(pd) / static_cast<double>(parts.size()) > dup_para_frac)
    return "repetition_dup_paragraphs";
  if (dup_para_char_frac > 0 && static_cast<double>(pc) / len > dup_para_char_frac)
    return "repetition_dup_paragraph_chars";
  // Lines: split on runs of newlines.
  parts.clear();
  {
    size_t b = 0;
    while (b <= text.size()) {
      size_t e = text.find('\n', b);
      if (e == std::string_view::npos) e = text.size();
      if (e > b || parts.empty() || b == text.size()) parts.push_back(text.substr(b, e - b));
      b = e + 1;
      while (b < text.size() && text[b] == '\n') ++b;
    }
  }
  auto [ld, lc] = find_duplicates(parts);
  if (dup_line_frac > 0 &&
      static_cast<double>(ld) / static_cast<double>(parts.size()) > dup_line_frac)
    return "repetition_dup_lines";
  if (dup_line_char_frac > 0 && static_cast<double>(lc) / len > dup_line_char_frac)
    return "repetition_dup_line_chars";
  split_words(text, words);
  return ngram_rules(words, len);
}

// The top and duplicated n-gram rules. An n-gram that occurs twice starts with an (n-1)-gram
// that occurs twice, so the sizes are visited in increasing order and each visits only the
// positions whose previous n-gram was repeated: after the first size few positions are left.
// Decisions are those of the rules taken one by one (datatrove's order: top, then dup).
const char* GopherRepetitionFilter::ngram_rules(const std::vector<std::string_view>& words,
                                                double len) const {
  const size_t nw = words.size();
  thread_local std::vector<uint64_t> wh, gram;  // word hashes; hash of the n-gram at each candidate
  thread_local std::vector<uint32_t> cand, slot, next;  // candidate positions, their table slots
  thread_local std::vector<size_t> chars;               // chars[i]: bytes of words [0, i)
  thread_local HashCounter counts;
  wh.resize(nw);
  chars.resize(nw + 1);
  chars[0] = 0;
  for (size_t i = 0; i < nw; ++i) {
    wh[i] = word_hash(words[i]);
    chars[i + 1] = chars[i] + words[i].size();
  }
  thread_local std::vector<int> sizes;
  sizes.clear();
  for (auto [n, f] : top_n_grams) sizes.push_back(n);
  for (auto [n, f] : dup_n_grams) sizes.push_back(n);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  auto fraction = [](const std::vector<std::pair<int, double>>& rule, int n) -> const double* {
    for (const auto& [m, f] : rule)
      if (m == n) return &f;
    return nullptr;
  };
  cand.clear();
  for (size_t i = 0; i < nw; ++i) cand.push_back(static_cast<uint32_t>(i));
  gram.assign(nw, 0x9e3779b97f4a7c15ull);
  int gram_len = 0;  // words hashed into gram[] so far
  bool dup_failed = false;
  for (int n : sizes) {
    const size_t un = static_cast<size_t>(n);
    // Extend the candidates' hashes to n words; drop candidates too close to the end.
    next.clear();
    for (uint32_t i : cand) {
      if (i + un > nw) continue;
      for (int k = gram_len; k < n; ++k) gram[i] = mix(gram[i], wh[i + static_cast<size_t>(k)]);
      next.push_back(i);
    }
    cand.swap(next);
    gram_len = n;
    counts.reset(cand.size());
    slot.resize(cand.size());
    // The most frequent n-gram, the first seen among equals (datatrove's most_common(1)).
    uint32_t best = 0;
    size_t best_at = 0;
    for (size_t k = 0; k < cand.size(); ++k) {
      auto& e = counts.find(gram[cand[k]], cand[k]);
      slot[k] = static_cast<uint32_t>(&e - counts.entries());
      if (++e.count > best || (e.count == best && e.first < best_at)) {
        best = e.count;
        best_at = e.first;
      }
    }
    if (const double* frac = fraction(top_n_grams, n); frac && best >= 2) {
      // Bytes of the n-gram as words joined by single spaces.
      const size_t glen = chars[best_at + un] - chars[best_at] + un - 1;
      if (static_cast<double>(glen * best) / len > *frac) return "repetition_top_ngram";
    }
    // Keep the repeated ones.
    next.clear();
    for (size_t k = 0; k < cand.size(); ++k)
      if (counts.entries()[slot[k]].count >= 2) next.push_back(cand[k]);
    cand.swap(next);
    if (const double* frac = fraction(dup_n_grams, n); frac && !dup_failed) {
      // Repeated n-grams, counted without overlap: after a repeat the scan jumps n words.
      // Positions outside `cand` hold n-grams seen once in the whole text, never repeats.
      thread_local HashCounter seen;
      seen.reset(cand.size());
      size_t rep = 0, from = 0;
      for (uint32_t i : cand) {
        if (i < from) continue;
        if (seen.find(gram[i], 0).count++ > 0) {
          rep += chars[i + un] - chars[i];
          from = i + un;
        }
      }
      dup_failed = static_cast<double>(rep) / len > *frac;
    }
    if (cand.empty()) break;
  }
  return dup_failed ? "repetition_dup_ngrams" : nullptr;
}

const char* C4Filter::apply(std::string_view text, std::string& out, int64_t& lines_removed) const {
  thread_local std::vector<std::string_view> lines, words;
  thread_local std::string cleaned, lower;
  split_lines(text, lines);
  out.clear();
  lines_removed = 0;
  int64_t sentences = 0;
  for (auto raw : lines) {
    auto s = strip(raw);
    split_words(s, words);
    bool long_word = false;
    // A word's characters are at most its bytes: only long words are counted.
    for (auto w : words)
      long_word |= max_word_length > 0 && static_cast<int64_t>(w.size()) > max_word_length &&
                   static_cast<int64_t>(utf8_length(w)) > max_word_length;
    if (long_word) {
      ++lines_removed;
      continue;
    }
    std::string_view ls = s;
    if (remove_citations && s.find('[') != std::string_view::npos) {
      // [1], [23], [edit], [citation needed]
      cleaned.clear();
      for (size_t i = 0; i < s.size();) {
        if (s[i] == '[') {
          size_t j = i + 1;
          while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
          if (j < s.size() && s[j] == ']') {
            i = j + 1;
            continue;
          }
          std::string_view rest = s.substr(i);
          if (starts_with(rest, "[edit]")) {
            i += 6;
            continue;
          }
          if (starts_with(rest, "[citation needed]")) {
            i += 17;
            continue;
          }
        }
        size_t next = s.find('[', i + 1);
        if (next == std::string_view::npos) next = s.size();
        cleaned.append(s.substr(i, next - i));
        i = next;
      }
      ls = cleaned;
    }
    if (filter_no_terminal_punct) {
      bool term = ends_with(ls, ".") || ends_with(ls, "?") || ends_with(ls, "!") ||
                  ends_with(ls, "\"") || ends_with(ls, "'");
      if (!term || ends_with(ls, "...")) {
        ++lines_removed;
        continue;
      }
    }
    if (static_cast<int64_t>(words.size()) < min_words_per_line) {
      ++lines_removed;
      continue;
    }
    lower.resize(ls.size());
    std::transform(ls.begin(), ls.end(), lower.begin(),
                   [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; });
    if (filter_lorem_ipsum && lower.find("lorem ipsum") != std::string::npos)
      return "c4_lorem_ipsum";
    if (filter_javascript && lower.find("javascript") != std::string::npos) {
      ++lines_removed;
      continue;
    }
    if (filter_curly_bracket && ls.find('{') != std::string_view::npos) return "c4_curly_bracket";
    if (filter_policy) {
      static const char* kPolicy[] = {"terms of use", "privacy policy", "cookie policy",
                                      "uses cookies", "use of cookies", "use cookies"};
      bool hit = false;
      for (const char* p : kPolicy) hit |= lower.find(p) != std::string::npos;
      if (hit) {
        ++lines_removed;
        continue;
      }
    }
    // Sentences: terminal punctuation followed by a space or the end of the line.
    int64_t n = 0;
    for (size_t i = 0; i < ls.size(); ++i)
      if ((ls[i] == '.' || ls[i] == '!' || ls[i] == '?') &&
          (i + 1 == ls.size() || ls[i + 1] == ' '))
        ++n;
    sentences += std::max<int64_t>(n, 1);
    if (!out.empty()) out += '\n';
    out += ls;
  }
  if (min_num_sentences > 0 && sentences < min_num_sentences) return "c4_too_few_sentences";
  if (out.empty()) return "c4_no_lines_left";
  return nullptr;
}

const char* FineWebFilter::check(std::string_view text) const {
  thread_local std::vector<std::string_view> all, lines, words;
  split_lines(text, all);
  lines.clear();
  for (auto l : all)
    if (!strip(l).empty()) lines.push_back(l);
  if (lines.empty()) return "fineweb_empty";
  const double nl = static_cast<double>(lines.size());
  size_t punct = 0, short_lines = 0;
  for (auto l : lines) {
    punct += ends_with(l, ".") || ends_with(l, "'") || ends_with(l, "\"") || ends_with(l, "!") ||
             ends_with(l, "?");
    // In characters, as datatrove's len(line): a line of CJK or Cyrillic text is not long
    // because its letters take two or three bytes each.
    short_lines += static_cast<int64_t>(utf8_length(l)) <= short_line_length;
  }
  // As in datatrove, a share must go past its bound (below it for line punctuation) to drop the
  // document.
  double r = static_cast<double>(punct) / nl;
  if (r < line_punct_thr && !(r == 0 && line_punct_exclude_zero)) return "fineweb_line_punct";
  if (static_cast<double>(short_lines) / nl > short_line_thr) return "fineweb_short_lines";
  size_t no_newlines =
      text.size() - static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
  auto [d, dc] = find_duplicates(lines);
  (void)d;
  if (no_newlines > 0 &&
      static_cast<double>(dc) / static_cast<double>(no_newlines) > char_duplicates_ratio)
    return "fineweb_char_dup";
  split_words(text, words);
  double newlines = static_cast<double>(std::count(text.begin(), text.end(), '\n'));
  if (!words.empty() && newlines / static_cast<double>(words.size()) > new_line_ratio)
    return "fineweb_list_ratio";
  return nullptr;
}

namespace {
// An n-gram rule's table: the sizes under `sizes_key`, their thresholds under `fracs_key`.
void load_ngram_rule(ConfigTable& t, const char* sizes_key, const char* fracs_key,
                     std::vector<std::pair<int, double>>& rule) {
  if (!t.has(sizes_key) && !t.has(fracs_key)) return;
  // A key left out keeps its default (`rule`'s), so thresholds alone apply to the default sizes.
  std::vector<double> sizes, fracs;
  for (const auto& [n, frac] : rule) {
    sizes.push_back(n);
    fracs.push_back(frac);
  }
  if (t.has(sizes_key)) sizes = t.get_doubles(sizes_key);
  if (t.has(fracs_key)) fracs = t.get_doubles(fracs_key);
  const auto given = [&](const char* key) { return t.has(key) ? "" : " (its default)"; };
  POLLEN_CHECK(sizes.size() == fracs.size(), t.where(t.has(fracs_key) ? fracs_key : sizes_key),
               ": expected one threshold per n: ", sizes_key, " has ", sizes.size(),
               given(sizes_key), ", ", fracs_key, " ", fracs.size(), given(fracs_key));
  rule.clear();
  for (size_t i = 0; i < sizes.size(); ++i) {
    POLLEN_CHECK(sizes[i] >= 1 && sizes[i] <= 1000 && sizes[i] == static_cast<int>(sizes[i]),
                 t.where(sizes_key), ": expected whole numbers from 1 to 1000, got ", sizes[i]);
    POLLEN_CHECK(fracs[i] >= 0 && fracs[i] <= 1, t.where(fracs_key),
                 ": expected fractions in [0, 1], got ", fracs[i]);
    rule.push_back({static_cast<int>(sizes[i]), fracs[i]});
  }
}
// A filter's [min, max] pair: both 0 or more, and min at most max unless max is 0 (no bound);
// else every document would be dropped.
void check_bounds(const ConfigTable& t, const char* min_key, double min, const char* max_key,
                  double max) {
  POLLEN_CHECK(min >= 0, t.where(min_key), ": expected 0 or more, got ", min);
  POLLEN_CHECK(max >= 0, t.where(max_key), ": expected 0 (no bound) or more, got ", max);
  POLLEN_CHECK(max == 0 || max >= min, t.where(max_key), ": ", max, " is less than ", min_key, " (",
               min, "): every document would be dropped");
}

}  // namespace

void load_filter(ConfigTable& t, LengthFilter& f) {
  f.enabled = t.get_bool("enabled", f.enabled);
  f.min_chars = t.get_int("min_chars", f.min_chars);
  f.max_chars = t.get_int("max_chars", f.max_chars);
  f.min_words = t.get_int("min_words", f.min_words);
  f.max_words = t.get_int("max_words", f.max_words);
  check_bounds(t, "min_chars", static_cast<double>(f.min_chars), "max_chars",
               static_cast<double>(f.max_chars));
  check_bounds(t, "min_words", static_cast<double>(f.min_words), "max_words",
               static_cast<double>(f.max_words));
}
void load_filter(ConfigTable& t, GopherQualityFilter& f) {
  f.enabled = t.get_bool("enabled", f.enabled);
  f.min_doc_words = t.get_int("min_doc_words", f.min_doc_words);
  f.max_doc_words = t.get_int("max_doc_words", f.max_doc_words);
  f.min_avg_word_length = t.get_double("min_avg_word_length", f.min_avg_word_length);
  f.max_avg_word_length = t.get_double("max_avg_word_length", f.max_avg_word_length);
  f.max_symbol_word_ratio = t.get_double("max_symbol_word_ratio", f.max_symbol_word_ratio);
  f.max_bullet_lines_ratio = t.get_double("max_bullet_lines_ratio", f.max_bullet_lines_ratio);
  f.max_ellipsis_lines_ratio = t.get_double("max_ellipsis_lines_ratio", f.max_ellipsis_lines_ratio);
  f.max_non_alpha_words_ratio =
      t.get_double("max_non_alpha_words_ratio", f.max_non_alpha_words_ratio);
  f.min_stop_words = t.get_int("min_stop_words", f.min_stop_words);
  check_bounds(t, "min_doc_words", static_cast<double>(f.min_doc_words), "max_doc_words",
               static_cast<double>(f.max_doc_words));
  check_bounds(t, "min_avg_word_length", f.min_avg_word_length, "max_avg_word_length",
               f.max_avg_word_length);
  POLLEN_CHECK(f.min_stop_words >= 0, t.where("min_stop_words"), ": expected 0 or more, got ",
               f.min_stop_words);
}
void load_filter(ConfigTable& t, GopherRepetitionFilter& f) {
  f.enabled = t.get_bool("enabled", f.enabled);
  f.dup_line_frac = t.get_double("dup_line_frac", f.dup_line_frac);
  f.dup_para_frac = t.get_double("dup_para_frac", f.dup_para_frac);
  f.dup_line_char_frac = t.get_double("dup_line_char_frac", f.dup_line_char_frac);
  f.dup_para_char_frac = t.get_double("dup_para_char_frac", f.dup_para_char_frac);
  load_ngram_rule(t, "top_n_grams", "top_n_gram_fracs", f.top_n_grams);
  load_ngram_rule(t, "dup_n_grams", "dup_n_gram_fracs", f.dup_n_grams);
}
void load_filter(ConfigTable& t, C4Filter& f) {
  f.enabled = t.get_bool("enabled", f.enabled);
  f.remove_citations = t.get_bool("remove_citations", f.remove_citations);
  f.filter_no_terminal_punct = t.get_bool("filter_no_terminal_punct", f.filter_no_terminal_punct);
  f.min_num_sentences = t.get_int("min_num_sentences", f.min_num_sentences);
  f.min_words_per_line = t.get_int("min_words_per_line", f.min_words_per_line);
  f.max_word_length = t.get_int("max_word_length", f.max_word_length);
  f.filter_lorem_ipsum = t.get_bool("filter_lorem_ipsum", f.filter_lorem_ipsum);
  f.filter_javascript = t.get_bool("filter_javascript", f.filter_javascript);
  f.filter_curly_bracket = t.get_bool("filter_curly_bracket", f.filter_curly_bracket);
  f.filter_policy = t.get_bool("filter_policy", f.filter_policy);
}
void load_filter(ConfigTable& t, FineWebFilter& f) {
  f.enabled = t.get_bool("enabled", f.enabled);
  f.line_punct_thr = t.get_double("line_punct_thr", f.line_punct_thr);
  f.line_punct_exclude_zero = t.get_bool("line_punct_exclude_zero", f.line_punct_exclude_zero);
  f.short_line_thr = t.get_double("short_line_thr", f.short_line_thr);
  f.short_line_length = t.get_int("short_line_length", f.short_line_length);
  f.char_duplicates_ratio = t.get_double("char_duplicates_ratio", f.char_duplicates_ratio);
  f.new_line_ratio = t.get_double("new_line_ratio", f.new_line_ratio);
}

}  // namespace pollen::data
