// Flash-style attention on the CPU.
//
// Work is cut into blocks of kBlock queries and kBlock keys. Each block is first gathered into
// a small contiguous scratch tile whose head dimension is padded with zeros to a whole number of
// SIMD tiles, so one register-blocked micro-kernel (gemm) does every product.
//
// forward:  one task per (b, kv head, query block) covering the query heads that share the kv
//           head; keys are visited in blocks with an online softmax.
// backward: one task per (b, kv head); for each key block it walks the query blocks of every
//           query head sharing that kv head, accumulating dk, dv in the block and dq for the
//           whole sequence in task scratch. Each output element is written by one task in a
//           fixed order: no atomics, and the result does not depend on the thread count.
#include "ops/cpu/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/thread_pool.h"

namespace pollen::ops::cpu {
namespace {

constexpr int64_t kBlock = 64;  // queries per query block and keys per key block

// One SIMD register of the widest vector ISA the build targets (-march=native), through the
// compiler's vector extension so that the micro-kernel tiles stay in registers. A tile of C is
// kTileRows rows by kTileVectors vectors: as many accumulators as the register file allows while
// leaving room for the B row and the broadcast A value.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
constexpr int64_t kTileRows = 8;  // 16 accumulators of 32 registers
#else
constexpr int kVectorBytes = 32;
constexpr int64_t kTileRows = 6;  // 12 accumulators of 16 registers
#endif
constexpr int64_t kTileVectors = 2;

template <typename T>
struct Simd {
  typedef T Vec __attribute__((vector_size(kVectorBytes)));
  static constexpr int64_t kLanes = kVectorBytes / sizeof(T);
  static Vec load(const T* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(T* p, Vec v) { std::memcpy(p, &v, sizeof v); }
};

template <typename T>
constexpr int64_t kTileCols = kTileVectors* Simd<T>::kLanes;

int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

// Rows [i, i + kRows) of C (m,n) = A (m,k) . B (k,n), or += with kAccumulate. Row-major with
// leading dimensions lda, ldb, ldc; with kTransposedA, A is stored transposed as (k,m).
template <int64_t kRows, bool kTransposedA, bool kAccumulate, typename T>
void gemm_rows(int64_t i, int64_t n, int64_t k, const T* __restrict a, int64_t lda,
               const T* __restrict b, int64_t ldb, T* __restrict c, int64_t ldc) {
  using S = Simd<T>;
  using Vec = typename S::Vec;
  for (int64_t j = 0; j < n; j += kTileCols<T>) {
    Vec acc[kRows][kTileVectors];
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t v = 0; v < kTileVectors; ++v)
        acc[r][v] = kAccumulate ? S::load(c + (i + r) * ldc + j + v * S::kLanes) : Vec{};
    for (int64_t p = 0; p < k; ++p) {
      Vec b_row[kTileVectors];
      for (int64_t v = 0; v < kTileVectors; ++v)
        b_row[v] = S::load(b + p * ldb + j + v * S::kLanes);
      for (int64_t r = 0; r < kRows; ++r) {
        const T a_rp = kTransposedA ? a[p * lda + i + r] : a[(i + r) * lda + p];
        for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] += a_rp * b_row[v];
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t v = 0; v < kTileVectors; ++v)
        S::store(c + (i + r) * ldc + j + v * S::kLanes, acc[r][v]);
  }
}

// C (m,n) = A (m,k) . B (k,n), or += with kAccumulate (see gemm_rows). m must be even and n a
// multiple of kTileCols<T>; callers pad their tiles.
template <bool kTransposedA, bool kAccumulate, typename T>
void gemm(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
          int64_t ldc) {
  int64_t i = 0;
  for (; i + kTileRows <= m; i += kTileRows)
    gemm_rows<kTileRows, kTransposedA, kAccumulate>(i, n, k, a, lda, b, ldb, c, ldc);
  for (; i + 4 <= m; i += 4)
    gemm_rows<4, kTransposedA, kAccumulate>(i, n, k, a, lda, b, ldb, c, ldc);
  for (; i < m; i += 2) gemm_rows<2, kTransposedA, kAccumulate>(i, n, k, a, lda, b, ldb, c, ldc);
}

// exp(x[j] - shift) for the kBlock values of a score row. float: the Cephes expf polynomial on
// SIMD vectors (arguments clamped to [-87, 88], so masked scores never overflow); double: std::exp.
void exp_shifted_row(const float* x, float shift, float* out) {
  using S = Simd<float>;
  using Vec = S::Vec;
  typedef int32_t IntVec __attribute__((vector_size(kVectorBytes)));
  const Vec round_magic = Vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  for (int64_t j = 0; j < kBlock; j += S::kLanes) {
    Vec t = S::load(x + j) - shift;
    t = t < -87.0f ? Vec{} - 87.0f : t;
    t = t > 88.0f ? Vec{} + 88.0f : t;
    const Vec shifted = t * 1.44269504088896341f + round_magic;
    const Vec n = shifted - round_magic;  // round(t / ln 2)
    const Vec r = t - n * 0.693359375f + n * 2.12194440e-4f;
    Vec p = Vec{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const Vec exp_r = p * r * r + r + 1.0f;
    const IntVec exponent = (std::bit_cast<IntVec>(shifted) - 0x4B400000 + 127) << 23;
    S::store(out + j, exp_r * std::bit_cast<Vec>(exponent));
  }
}

void exp_shifted_row(const double* x, double shift, double* out) {
  for (int64_t j = 0; j < kBlock; ++j) out[j] = std::exp(x[j] - shift);
}

// Copies `rows` rows of `dim` values, `stride` apart in src, times `factor`, into the top of a
// (kBlock, padded_dim) tile; the rest of the tile is zero.
template <typename T>
void gather_rows(const T* src, int64_t stride, int64_t rows, int64_t dim, int64_t padded_dim,
                 T factor, T* __restrict tile) {
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = tile + r * padded_dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = src[r * stride + d] * factor;
    std::fill(dst + dim, dst + padded_dim, T(0));
  }
  std::fill(tile + rows * padded_dim, tile + kBlock * padded_dim, T(0));
}

// The same rows transposed into a (padded_dim, kBlock) tile.
template <typename T>
void gather_rows_transposed(const T* src, int64_t stride, int64_t rows, int64_t dim,
                            int64_t padded_dim, T* __restrict tile) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) tile[d * kBlock + r] = src[r * stride + d];
  for (int64_t d = 0; d < dim; ++d)
    std::fill(tile + d * kBlock + rows, tile + (d + 1) * kBlock, T(0));
  std::fill(tile + dim * kBlock, tile + padded_dim * kBlock, T(0));
}

// Keys [lo, hi) of the key block starting at key0 (of key_rows keys) that query i may see,
// relative to key0; empty (lo >= hi) when none.
struct KeyRange {
  int64_t lo, hi;
};
KeyRange visible_keys(const int32_t* seg_start, int64_t i, int64_t key0, int64_t key_rows) {
  return {std::max<int64_t>(seg_start[i], key0) - key0, std::min(i + 1, key0 + key_rows) - key0};
}

// Turns a row of scores into exp(score - shift) on the visible keys and zero elsewhere.
template <typename T>
void exp_visible(T* row, KeyRange keys, T shift) {
  exp_shifted_row(row, shift, row);
  std::fill(row, row + keys.lo, T(0));
  std::fill(row + keys.hi, row + kBlock, T(0));
}

// The largest score of a row on the visible keys, after setting the others to -inf (max is
// exact in any order, so it runs over SIMD lanes).
template <typename T>
T visible_max(T* row, KeyRange keys) {
  using S = Simd<T>;
  using Vec = typename S::Vec;
  std::fill(row, row + keys.lo, -std::numeric_limits<T>::infinity());
  std::fill(row + keys.hi, row + kBlock, -std::numeric_limits<T>::infinity());
  Vec lanes = S::load(row);
  for (int64_t j = S::kLanes; j < kBlock; j += S::kLanes) {
    const Vec x = S::load(row + j);
    lanes = x > lanes ? x : lanes;
  }
  T max = lanes[0];
  for (int64_t l = 1; l < S::kLanes; ++l) max = std::max<T>(max, lanes[l]);
  return max;
}

// The sum of a row, always in the same order: SIMD lanes first, then the lanes in turn.
template <typename T>
T row_sum_of(const T* row) {
  using S = Simd<T>;
  using Vec = typename S::Vec;
  Vec lanes = S::load(row);
  for (int64_t j = S::kLanes; j < kBlock; j += S::kLanes) lanes += S::load(row + j);
  T sum = lanes[0];
  for (int64_t l = 1; l < S::kLanes; ++l) sum += lanes[l];
  return sum;
}

// Geometry shared by the tasks of one call: strides of q-like (H) and kv-like (KVH) rows.
template <typename T>
struct Layout {
  explicit Layout(const AttentionShape& s)
      : shape(s),
        group(s.heads / s.kv_heads),
        padded_dim(round_up(s.head_dim, kTileCols<T>)),
        q_stride(s.heads * s.head_dim),
        kv_stride(s.kv_heads * s.head_dim) {}
  // Offsets of row (b, t) of head h in q-like and kv-like tensors.
  int64_t q_at(int64_t b, int64_t t, int64_t h) const {
    return (b * shape.seq + t) * q_stride + h * shape.head_dim;
  }
  int64_t kv_at(int64_t b, int64_t t, int64_t h) const {
    return (b * shape.seq + t) * kv_stride + h * shape.head_dim;
  }
  AttentionShape shape;
  int64_t group, padded_dim, q_stride, kv_stride;
};

// ---- forward ----------------------------------------------------------------------------------

template <typename T>
struct ForwardScratch {
  ForwardScratch(int64_t padded_dim, int64_t group)
      : q(group * kBlock * padded_dim),
        out(group * kBlock * padded_dim),
        k_transposed(kBlock * padded_dim),
        v(kBlock * padded_dim),
        probs(kBlock * kBlock),
        row_max(group * kBlock),
        row_sum(group * kBlock) {}
  std::vector<T> q, out;            // (group,kBlock,Dp): q * scale, unnormalised out
  std::vector<T> k_transposed;      // (Dp,kBlock)
  std::vector<T> v;                 // (kBlock,Dp)
  std::vector<T> probs;             // (kBlock,kBlock) scores, then probabilities
  std::vector<T> row_max, row_sum;  // (group,kBlock) online softmax state
};

// Online softmax over one key block for one head: turns its scores into probabilities relative
// to the running row maxima, and rescales the running sums and outputs where a maximum grew.
template <typename T>
void online_softmax_block(const int32_t* seg, int64_t query0, int64_t query_rows, int64_t tile_rows,
                          int64_t key0, int64_t key_rows, int64_t dp, T* probs, T* row_max,
                          T* row_sum, T* out) {
  for (int64_t r = 0; r < tile_rows; ++r) {
    T* row = probs + r * kBlock;
    const KeyRange keys =
        r < query_rows ? visible_keys(seg, query0 + r, key0, key_rows) : KeyRange{0, 0};
    if (keys.lo >= keys.hi) {
      std::fill(row, row + kBlock, T(0));
      continue;
    }
    const T new_max = std::max(row_max[r], visible_max(row, keys));
    exp_visible(row, keys, new_max);
    const T rescale = std::exp(row_max[r] - new_max);  // 0 on the first visible block
    row_sum[r] = row_sum[r] * rescale + row_sum_of(row);
    row_max[r] = new_max;
    if (rescale != T(1))
      for (int64_t d = 0; d < dp; ++d) out[r * dp + d] *= rescale;
  }
}

// out and lse of the queries [query0, query0 + kBlock) of every query head reading kv head g in
// batch row b; each key block is gathered once for all of them.
template <typename T>
void forward_query_block(const Layout<T>& L, const T* q, const T* k, const T* v,
                         const int32_t* seg_start, T scale, int64_t b, int64_t g, int64_t query0,
                         ForwardScratch<T>& s, T* out, T* lse) {
  const int64_t seq = L.shape.seq, dim = L.shape.head_dim, dp = L.padded_dim;
  const int64_t query_rows = std::min(kBlock, seq - query0);
  const int64_t tile_rows = round_up(query_rows, 2);
  const int32_t* seg = seg_start + b * seq;
  const int64_t tile = kBlock * dp;

  for (int64_t member = 0; member < L.group; ++member) {
    gather_rows(q + L.q_at(b, query0, g * L.group + member), L.q_stride, query_rows, dim, dp, scale,
                s.q.data() + member * tile);
  }
  std::fill(s.out.begin(), s.out.end(), T(0));
  std::fill(s.row_max.begin(), s.row_max.end(), -std::numeric_limits<T>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.end(), T(0));

  const int64_t first_key = seg[query0] / kBlock * kBlock;
  for (int64_t key0 = first_key; key0 < query0 + query_rows; key0 += kBlock) {
    const int64_t key_rows = std::min(kBlock, seq - key0);
    gather_rows_transposed(k + L.kv_at(b, key0, g), L.kv_stride, key_rows, dim, dp,
                           s.k_transposed.data());
    gather_rows(v + L.kv_at(b, key0, g), L.kv_stride, key_rows, dim, dp, T(1), s.v.data());
    for (int64_t member = 0; member < L.group; ++member) {
      T* out_tile = s.out.data() + member * tile;
      // probs (rows,kBlock) = (q * scale) k^T, then softmax; out (rows,Dp) += probs v
      gemm<false, false>(tile_rows, kBlock, dp, s.q.data() + member * tile, dp,
                         s.k_transposed.data(), kBlock, s.probs.data(), kBlock);
      online_softmax_block(seg, query0, query_rows, tile_rows, key0, key_rows, dp, s.probs.data(),
                           s.row_max.data() + member * kBlock, s.row_sum.data() + member * kBlock,
                           out_tile);
      gemm<false, true>(tile_rows, dp, kBlock, s.probs.data(), kBlock, s.v.data(), dp, out_tile,
                        dp);
    }
  }

  for (int64_t member = 0; member < L.group; ++member) {
    const int64_t h = g * L.group + member;
    for (int64_t r = 0; r < query_rows; ++r) {
      const T row_sum = s.row_sum[member * kBlock + r];
      const T* src = s.out.data() + member * tile + r * dp;
      T* dst = out + L.q_at(b, query0 + r, h);
      for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * (T(1) / row_sum);
      lse[(b * L.shape.heads + h) * seq + query0 + r] =
          s.row_max[member * kBlock + r] + std::log(row_sum);
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------

template <typename T>
struct BackwardScratch {
  BackwardScratch(int64_t padded_dim, int64_t group, int64_t seq)
      : k(kBlock * padded_dim),
        k_transposed(kBlock * padded_dim),
        v_transposed(kBlock * padded_dim),
        q(kBlock * padded_dim),
        dout(kBlock * padded_dim),
        dk(kBlock * padded_dim),
        dv(kBlock * padded_dim),
        probs(kBlock * kBlock),
        dscores(kBlock * kBlock),
        delta(group * seq),
        dq(group * round_up(seq, kBlock) * padded_dim) {}
  std::vector<T> k, k_transposed, v_transposed;  // (kBlock,Dp), (Dp,kBlock), (Dp,kBlock)
  std::vector<T> q, dout;                        // (kBlock,Dp): q * scale, dout
  std::vector<T> dk, dv;                         // (kBlock,Dp) of the current key block
  std::vector<T> probs, dscores;                 // (kBlock,kBlock)
  std::vector<T> delta;                          // (group,T): rowsum(dout * out)
  std::vector<T> dq;                             // (group,T rounded up to kBlock,Dp)
};

// dq of the query heads of kv head g, and dk, dv of kv head g, in batch row b.
template <typename T>
void backward_kv_head(const Layout<T>& L, const T* q, const T* k, const T* v,
                      const int32_t* seg_start, const T* out, const T* lse, const T* dout, T scale,
                      int64_t b, int64_t g, BackwardScratch<T>& s, T* dq, T* dk, T* dv) {
  const int64_t seq = L.shape.seq, dim = L.shape.head_dim, dp = L.padded_dim;
  const int64_t padded_seq = round_up(seq, kBlock);
  const int32_t* seg = seg_start + b * seq;

  for (int64_t member = 0; member < L.group; ++member) {
    const int64_t h = g * L.group + member;
    for (int64_t t = 0; t < seq; ++t) {
      const T* o = out + L.q_at(b, t, h);
      const T* dO = dout + L.q_at(b, t, h);
      T sum = 0;
      for (int64_t d = 0; d < dim; ++d) sum += dO[d] * o[d];
      s.delta[member * seq + t] = sum;
    }
  }
  std::fill(s.dq.begin(), s.dq.end(), T(0));

  for (int64_t key0 = 0; key0 < seq; key0 += kBlock) {
    const int64_t key_rows = std::min(kBlock, seq - key0);
    const T* k_block = k + L.kv_at(b, key0, g);
    const T* v_block = v + L.kv_at(b, key0, g);
    gather_rows(k_block, L.kv_stride, key_rows, dim, dp, T(1), s.k.data());
    gather_rows_transposed(k_block, L.kv_stride, key_rows, dim, dp, s.k_transposed.data());
    gather_rows_transposed(v_block, L.kv_stride, key_rows, dim, dp, s.v_transposed.data());
    std::fill(s.dk.begin(), s.dk.end(), T(0));
    std::fill(s.dv.begin(), s.dv.end(), T(0));
    // Queries that see this key block: from key0 up to the first whose document starts after it.
    int64_t query_end = key0 + key_rows;
    while (query_end < seq && seg[query_end] < key0 + key_rows) ++query_end;

    for (int64_t member = 0; member < L.group; ++member) {
      const int64_t h = g * L.group + member;
      const T* lse_h = lse + (b * L.shape.heads + h) * seq;
      const T* delta_h = s.delta.data() + member * seq;
      for (int64_t query0 = key0; query0 < query_end; query0 += kBlock) {
        const int64_t query_rows = std::min(kBlock, query_end - query0);
        const int64_t tile_rows = round_up(query_rows, 2);
        gather_rows(q + L.q_at(b, query0, h), L.q_stride, query_rows, dim, dp, scale, s.q.data());
        gather_rows(dout + L.q_at(b, query0, h), L.q_stride, query_rows, dim, dp, T(1),
                    s.dout.data());
        // probs = exp((q * scale) k^T - lse); dscores = probs * (dout v^T - delta)
        gemm<false, false>(tile_rows, kBlock, dp, s.q.data(), dp, s.k_transposed.data(), kBlock,
                           s.probs.data(), kBlock);
        gemm<false, false>(tile_rows, kBlock, dp, s.dout.data(), dp, s.v_transposed.data(), kBlock,
                           s.dscores.data(), kBlock);
        for (int64_t r = 0; r < tile_rows; ++r) {
          T* p = s.probs.data() + r * kBlock;
          T* ds = s.dscores.data() + r * kBlock;
          const int64_t i = query0 + r;
          const KeyRange keys =
              r < query_rows ? visible_keys(seg, i, key0, key_rows) : KeyRange{0, 0};
          if (keys.lo >= keys.hi) {
            std::fill(p, p + kBlock, T(0));
            std::fill(ds, ds + kBlock, T(0));
            continue;
          }
          exp_visible(p, keys, lse_h[i]);
          for (int64_t j = 0; j < kBlock; ++j) ds[j] = p[j] * (ds[j] - delta_h[i]);
        }
        // dv (kBlock,Dp) += probs^T dout; dk += dscores^T (q * scale); dq += dscores k
        gemm<true, true>(kBlock, dp, tile_rows, s.probs.data(), kBlock, s.dout.data(), dp,
                         s.dv.data(), dp);
        gemm<true, true>(kBlock, dp, tile_rows, s.dscores.data(), kBlock, s.q.data(), dp,
                         s.dk.data(), dp);
        gemm<false, true>(tile_rows, dp, kBlock, s.dscores.data(), kBlock, s.k.data(), dp,
                          s.dq.data() + (member * padded_seq + query0) * dp, dp);
      }
    }
    for (int64_t r = 0; r < key_rows; ++r) {
      std::copy_n(s.dk.data() + r * dp, dim, dk + L.kv_at(b, key0 + r, g));
      std::copy_n(s.dv.data() + r * dp, dim, dv + L.kv_at(b, key0 + r, g));
    }
  }

  for (int64_t member = 0; member < L.group; ++member) {
    const int64_t h = g * L.group + member;
    for (int64_t t = 0; t < seq; ++t) {
      const T* src = s.dq.data() + (member * padded_seq + t) * dp;
      T* dst = dq + L.q_at(b, t, h);
      for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * scale;
    }
  }
}

}  // namespace

void segment_starts(const int32_t* doc_ids, int64_t batch, int64_t seq, int32_t* seg_start) {
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* ids = doc_ids + b * seq;
    int32_t* starts = seg_start + b * seq;
    for (int64_t t = 0; t < seq; ++t)
      starts[t] = (t > 0 && ids[t] == ids[t - 1]) ? starts[t - 1] : static_cast<int32_t>(t);
  }
}

template <typename T>
void attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v,
                       const int32_t* seg_start, T scale, T* out, T* lse) {
  const Layout<T> layout(shape);
  const int64_t query_blocks = (shape.seq + kBlock - 1) / kBlock;
  parallel_for(shape.batch * shape.kv_heads * query_blocks, 1, [&](int64_t begin, int64_t end) {
    ForwardScratch<T> scratch(layout.padded_dim, layout.group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / query_blocks;
      forward_query_block(layout, q, k, v, seg_start, scale, bg / shape.kv_heads,
                          bg % shape.kv_heads, task % query_blocks * kBlock, scratch, out, lse);
    }
  });
}

template <typename T>
void attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v,
                        const int32_t* seg_start, const T* out, const T* lse, const T* dout,
                        T scale, T* dq, T* dk, T* dv) {
  const Layout<T> layout(shape);
  parallel_for(shape.batch * shape.kv_heads, 1, [&](int64_t begin, int64_t end) {
    BackwardScratch<T> scratch(layout.padded_dim, layout.group, shape.seq);
    for (int64_t task = begin; task < end; ++task)
      backward_kv_head(layout, q, k, v, seg_start, out, lse, dout, scale, task / shape.kv_heads,
                       task % shape.kv_heads, scratch, dq, dk, dv);
  });
}

template void attention_forward(const AttentionShape&, const float*, const float*, const float*,
                                const int32_t*, float, float*, float*);
template void attention_forward(const AttentionShape&, const double*, const double*, const double*,
                                const int32_t*, double, double*, double*);
template void attention_backward(const AttentionShape&, const float*, const float*, const float*,
                                 const int32_t*, const float*, const float*, const float*, float,
                                 float*, float*, float*);
template void attention_backward(const AttentionShape&, const double*, const double*, const double*,
                                 const int32_t*, const double*, const double*, const double*,
                                 double, double*, double*, double*);

}  // namespace pollen::ops::cpu
