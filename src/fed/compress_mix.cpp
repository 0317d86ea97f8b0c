#include "fed/compress_mix.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace pollen::fed {
namespace {

constexpr int kLevels = 6;
constexpr int kLevelBits = 3;
constexpr Codec kLevelCodec[kLevels] = {Codec::none, Codec::sign, Codec::nf2,
                                        Codec::nf3,  Codec::int4, Codec::int8};

int64_t blocks_of(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

uint64_t header_bytes(int64_t blocks) {
  return (static_cast<uint64_t>(blocks) * kLevelBits + 7) / 8;
}

// How level l codes one block of `len` values.
CompressOptions level_options(int l, int64_t len, const CompressOptions& o) {
  CompressOptions lo;
  lo.codec = kLevelCodec[l];
  lo.block = len;
  lo.scale = o.scale;
  return lo;
}

uint64_t level_bytes(int l, int64_t len, const CompressOptions& o) {
  return l == 0 ? 0 : encoded_bytes(level_options(l, len, o), len);
}

// Per block and level: the squared error of coding the block at that level, and its bytes.
struct Costs {
  std::vector<double> error;  // [blocks * kLevels]
  std::vector<uint64_t> bytes;
};

Costs level_costs(const float* x, int64_t n, const CompressOptions& o) {
  const int64_t nb = blocks_of(n, o.block);
  Costs c{std::vector<double>(static_cast<size_t>(nb * kLevels)),
          std::vector<uint64_t>(static_cast<size_t>(nb * kLevels))};
  std::string enc;
  std::vector<float> y(static_cast<size_t>(o.block));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * o.block, len = std::min(n, lo + o.block) - lo;
    for (int l = 0; l < kLevels; ++l) {
      const auto at = static_cast<size_t>(b * kLevels + l);
      double sse = 0;
      if (l == 0) {
        for (int64_t i = 0; i < len; ++i) sse += static_cast<double>(x[lo + i]) * x[lo + i];
      } else {
        const CompressOptions lo_options = level_options(l, len, o);
        enc.clear();
        encode(x + lo, len, lo_options, enc);
        decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), len, lo_options, y.data(),
               "mix");
        for (int64_t i = 0; i < len; ++i) {
          const double e = static_cast<double>(y[static_cast<size_t>(i)]) - x[lo + i];
          sse += e * e;
        }
      }
      c.error[at] = sse;
      c.bytes[at] = level_bytes(l, len, o);
    }
  }
  return c;
}

// Each block's level minimising error + lambda * bits (ties: the fewer bits), and their bytes.
uint64_t choose(const Costs& c, double lambda, std::vector<int>& levels) {
  uint64_t total = 0;
  for (size_t b = 0; b < levels.size(); ++b) {
    int best = 0;
    double best_cost = INFINITY;
    for (int l = 0; l < kLevels; ++l) {
      const size_t at = b * kLevels + static_cast<size_t>(l);
      const double cost = c.error[at] + lambda * 8.0 * static_cast<double>(c.bytes[at]);
      if (cost < best_cost || (cost == best_cost && c.bytes[at] < c.bytes[b * kLevels + best])) {
        best = l, best_cost = cost;
      }
    }
    levels[b] = best;
    total += c.bytes[b * kLevels + static_cast<size_t>(best)];
  }
  return total;
}

// Spends what the levels of a multiplier left over: one block at a time, the finer level with the
// most error removed per byte that still fits.
void fill(const Costs& c, uint64_t left, std::vector<int>& levels) {
  for (;;) {
    size_t best_block = 0;
    int best_level = -1;
    double best_gain = 0;
    for (size_t b = 0; b < levels.size(); ++b) {
      const size_t now = b * kLevels + static_cast<size_t>(levels[b]);
      for (int l = 0; l < kLevels; ++l) {
        const size_t at = b * kLevels + static_cast<size_t>(l);
        if (c.bytes[at] <= c.bytes[now] || c.bytes[at] - c.bytes[now] > left) continue;
        const double gain =
            (c.error[now] - c.error[at]) / static_cast<double>(c.bytes[at] - c.bytes[now]);
        if (gain > best_gain) best_block = b, best_level = l, best_gain = gain;
      }
    }
    if (best_level < 0) return;
    const size_t now = best_block * kLevels + static_cast<size_t>(levels[best_block]);
    left -= c.bytes[best_block * kLevels + static_cast<size_t>(best_level)] - c.bytes[now];
    levels[best_block] = best_level;
  }
}

double total_error(const Costs& c, const std::vector<int>& levels) {
  double e = 0;
  for (size_t b = 0; b < levels.size(); ++b)
    e += c.error[b * kLevels + static_cast<size_t>(levels[b])];
  return e;
}

}  // namespace

uint64_t mix_encoded_bytes(const CompressOptions& o, int64_t n) {
  // nf2 on every block, each coded alone (its codes ending on a byte): nf2's bytes for the whole
  // tensor when the block is a multiple of 4, a little more otherwise.
  const int64_t nb = blocks_of(n, o.block);
  if (nb == 0) return 0;
  const int64_t last = n - (nb - 1) * o.block;
  return header_bytes(nb) + static_cast<uint64_t>(nb - 1) * level_bytes(2, o.block, o) +
         level_bytes(2, last, o);
}

void mix_encode(const float* x, int64_t n, const CompressOptions& o, uint8_t* p) {
  const int64_t nb = blocks_of(n, o.block);
  const uint64_t size = mix_encoded_bytes(o, n), header = header_bytes(nb);
  const uint64_t budget = size - header;
  std::memset(p, 0, static_cast<size_t>(size));
  const Costs costs = level_costs(x, n, o);
  std::vector<int> levels(static_cast<size_t>(nb));
  if (choose(costs, 0, levels) > budget) {
    // At lambda = hi every block is skipped, which fits: a block's error unsent is at most
    // 8 hi, less than lambda times any coding's bits. Bisect for the smallest lambda that fits.
    double lo = 0, hi = 0;
    for (int64_t b = 0; b < nb; ++b)
      hi = std::max(hi, costs.error[static_cast<size_t>(b) * kLevels]);
    hi = hi / 8 + 1e-300;
    for (int i = 0; i < 200 && lo < hi; ++i) {
      const double mid = lo + (hi - lo) / 2;
      if (mid <= lo || mid >= hi) break;
      (choose(costs, mid, levels) > budget ? lo : hi) = mid;
    }
    const uint64_t used = choose(costs, hi, levels);
    fill(costs, budget - used, levels);
    // nf2 on every block fits too; keep it where the search ended with a larger error
    if (total_error(costs, levels) > total_error(costs, std::vector<int>(levels.size(), 2)))
      std::fill(levels.begin(), levels.end(), 2);
  }
  uint64_t at = header;
  std::string enc;
  for (int64_t b = 0; b < nb; ++b) {
    const int l = levels[static_cast<size_t>(b)];
    const auto bit = static_cast<uint64_t>(b) * kLevelBits;
    const unsigned v = static_cast<unsigned>(l) << (bit % 8);
    p[bit / 8] |= static_cast<uint8_t>(v);
    if (v > 0xffu) p[bit / 8 + 1] |= static_cast<uint8_t>(v >> 8);
    if (l == 0) continue;
    const int64_t lo = b * o.block, len = std::min(n, lo + o.block) - lo;
    enc.clear();
    encode(x + lo, len, level_options(l, len, o), enc);
    std::memcpy(p + at, enc.data(), enc.size());
    at += enc.size();
  }
}

void mix_decode(const uint8_t* p, int64_t n, const CompressOptions& o, float* out,
                const std::string& what) {
  const int64_t nb = blocks_of(n, o.block);
  const uint64_t size = mix_encoded_bytes(o, n), header = header_bytes(nb);
  uint64_t at = header;
  for (int64_t b = 0; b < nb; ++b) {
    const auto bit = static_cast<uint64_t>(b) * kLevelBits;
    unsigned v = p[bit / 8];
    if (bit / 8 + 1 < header) v |= static_cast<unsigned>(p[bit / 8 + 1]) << 8;
    const auto l = static_cast<int>((v >> (bit % 8)) & 7u);
    POLLEN_CHECK(l < kLevels, what, ": block ", b, " has level ", l, "; mix levels are 0 to ",
                 kLevels - 1);
    const int64_t lo = b * o.block, len = std::min(n, lo + o.block) - lo;
    if (l == 0) {
      std::fill(out + lo, out + lo + len, 0.0f);
      continue;
    }
    const uint64_t bytes = level_bytes(l, len, o);
    POLLEN_CHECK(at + bytes <= size, what, ": block ", b, "'s ", codec_name(kLevelCodec[l]),
                 " coding ends at byte ", at + bytes, ", past the payload's ", size);
    decode(p + at, bytes, len, level_options(l, len, o), out + lo, what);
    at += bytes;
  }
  const auto used = static_cast<unsigned>(static_cast<uint64_t>(nb) * kLevelBits % 8);
  POLLEN_CHECK(used == 0 || (p[header - 1] >> used) == 0, what,
               ": the unused bits after the last level are not zero");
  for (uint64_t i = at; i < size; ++i) {
    POLLEN_CHECK(p[i] == 0, what, ": byte ", i, " after the last block's coding is not zero");
  }
}

std::vector<float> mix_error_bound(const float* x, int64_t n, const CompressOptions& o) {
  std::vector<float> bound(static_cast<size_t>(n));
  for (int64_t lo = 0; lo < n; lo += o.block) {
    const int64_t len = std::min(n, lo + o.block) - lo;
    for (int64_t i = 0; i < len; ++i) bound[static_cast<size_t>(lo + i)] = std::fabs(x[lo + i]);
    for (int l = 1; l < kLevels; ++l) {
      const auto b = error_bound(x + lo, len, level_options(l, len, o));
      for (int64_t i = 0; i < len; ++i) {
        float& at = bound[static_cast<size_t>(lo + i)];
        at = std::max(at, b[static_cast<size_t>(i)]);
      }
    }
  }
  return bound;
}

}  // namespace pollen::fed
