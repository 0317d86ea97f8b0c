#pragma once
// The CUDA attention kernels' work, written once for the GPU and the CPU.
//
// Every kernel of src/ops/cuda/attention.cu is a thin wrapper around one of the block functions
// below (forward_block, backward_dq_block, backward_dkdv_block). A block function is the whole
// schedule of one thread block: which tiles it loads, which key tiles it visits and in what
// order, and the phases between barriers. It hands each phase to `block.run(phase)`, which on the
// GPU runs the phase in the calling thread and then waits at __syncthreads(), and on the CPU
// (tests/ops/cuda_attention_tiles_test.cpp) runs the phase for each of the kAttentionThreads
// threads in turn. The arithmetic (online softmax, rescaling, dS = P * (dP - delta)) is in the
// small functions at the top, shared by both. So the CPU test checks the tile indexing, the GQA
// head mapping, the segment skipping and the math of the kernels against ops::attention_forward
// and attention_backward; it cannot check what only a GPU does (the launch itself, the real
// interleaving of threads, bf16 conversion intrinsics, shared-memory limits).
//
// Layouts are the CPU op's: q (B,T,H,D), k and v (B,T,KVH,D), seg_start (B,T) int32, out
// (B,T,H,D), lse (B,H,T); head h reads kv head h / (H / KVH). Query i sees keys j with
// seg_start[i] <= j <= i. All arithmetic is in float; tensors in device memory are float or
// bf16, converted on load and store (Element<T>).
#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define POLLEN_HD __host__ __device__ __forceinline__
#define POLLEN_UNROLL _Pragma("unroll")
#else
#define POLLEN_HD inline
#define POLLEN_UNROLL
#endif

namespace pollen::ops::cuda {

struct AttentionShape {
  int64_t batch, seq, heads, kv_heads, head_dim;  // B, T, H, KVH, D
};

constexpr int kAttentionThreads = 256;  // threads per block
constexpr int kTile = 64;               // queries per query tile and keys per key tile
constexpr int kLanes = 16;              // (kTile, kTile) tiles: 16 x 16 micro tiles of 4 x 4
constexpr int kMicro = kTile / kLanes;
static_assert(kLanes * kLanes == kAttentionThreads, "one thread per micro tile");
constexpr int kScoreRow = kTile + 1;  // row stride of score tiles (+1: no bank conflicts)

// Thread tid owns rows lane_row(tid) + kLanes * i and columns lane_col(tid) + kLanes * c of every
// tile it accumulates: within a warp the columns are consecutive and two rows are read at once.
POLLEN_HD int lane_row(int tid) {
  return tid / kLanes;
}
POLLEN_HD int lane_col(int tid) {
  return tid % kLanes;
}

// Float conversion of the element types in device memory; attention.cu adds __nv_bfloat16.
template <typename T>
struct Element;
template <>
struct Element<float> {
  POLLEN_HD static float load(float x) { return x; }
  POLLEN_HD static float store(float x) { return x; }
};

// ---- the arithmetic --------------------------------------------------------------------------

POLLEN_HD bool key_visible(int32_t seg_start_of_query, int64_t query, int64_t key) {
  return key >= seg_start_of_query && key <= query;
}

// Online softmax: a row's running maximum grew from old_max to new_max; the running sum and
// output are multiplied by this. Both -inf (nothing seen yet) keeps them as they are (zero).
POLLEN_HD float softmax_rescale(float old_max, float new_max) {
  return old_max == new_max ? 1.0f : expf(old_max - new_max);
}

// exp(score - shift), with masked scores (-inf) giving 0 even when the shift is -inf too.
POLLEN_HD float shifted_exp(float score, float shift) {
  return score == -INFINITY ? 0.0f : expf(score - shift);
}

// logsumexp of a row from its online-softmax state.
POLLEN_HD float row_lse(float row_max, float row_sum) {
  return row_max + logf(row_sum);
}

// The backward's dS = P * (dP - delta), delta = rowsum(dout * out).
POLLEN_HD float score_gradient(float p, float dp, float delta) {
  return p * (dp - delta);
}

// ---- the tile schedule -----------------------------------------------------------------------

POLLEN_HD int64_t tile_count(int64_t seq) {
  return (seq + kTile - 1) / kTile;
}

// Key tiles [first, end) that the queries [query0, query0 + rows) see: from the tile holding the
// first query's document start to the tile holding the last query. Every tile in between holds a
// key the first query sees, so none is skipped that matters and none is visited that does not.
struct TileRange {
  int64_t first, end;
};
POLLEN_HD TileRange key_tiles_for_queries(int32_t seg_start_of_first_query, int64_t query0,
                                          int64_t rows) {
  return {seg_start_of_first_query / kTile, (query0 + rows - 1) / kTile + 1};
}

// The queries that see a key in [key0, key0 + rows) are [key0, end): seg_start is non-decreasing,
// so they end at the first query at or after the tile's last key whose document starts after it.
POLLEN_HD int64_t query_end_for_keys(const int32_t* seg_start_row, int64_t seq, int64_t key0,
                                     int64_t rows) {
  const int64_t last_key = key0 + rows - 1;
  int64_t lo = last_key + 1, hi = seq;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (seg_start_row[mid] > last_key) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// ---- geometry and arguments ------------------------------------------------------------------

struct Geometry {
  AttentionShape s;
  POLLEN_HD int64_t group() const { return s.heads / s.kv_heads; }
  // Offsets of row (b, t) of query head h, of kv head g, and of (b, h, t) in lse-like arrays.
  POLLEN_HD int64_t q_at(int64_t b, int64_t t, int64_t h) const {
    return ((b * s.seq + t) * s.heads + h) * s.head_dim;
  }
  POLLEN_HD int64_t kv_at(int64_t b, int64_t t, int64_t g) const {
    return ((b * s.seq + t) * s.kv_heads + g) * s.head_dim;
  }
  POLLEN_HD int64_t row_at(int64_t b, int64_t h, int64_t t) const {
    return (b * s.heads + h) * s.seq + t;
  }
};

// The rows of the tile starting at row `first` of `end`: kTile, or fewer in the last tile.
POLLEN_HD int64_t tile_rows(int64_t end, int64_t first) {
  return end - first < kTile ? end - first : kTile;
}

// Where a block of a query-tile grid (x = query tile, y = b * H + h) works: batch row b, query
// head h and its kv head, the tile's first query and its rows.
struct QueryTileAt {
  int64_t b, h, kv, query0, rows;
};
POLLEN_HD QueryTileAt query_tile_at(const Geometry& g, int64_t query_tile, int64_t bh) {
  const int64_t h = bh % g.s.heads, query0 = query_tile * kTile;
  return {bh / g.s.heads, h, h / g.group(), query0, tile_rows(g.s.seq, query0)};
}

// Pointers of one forward call: q (B,T,H,D), k v (B,T,KVH,D) in, out (B,T,H,D) and lse (B,H,T)
// out.
template <typename T>
struct ForwardArgs {
  Geometry geo;
  const T *q, *k, *v;
  const int32_t* seg_start;  // (B,T)
  float scale;
  T* out;
  float* lse;
};

// Pointers of one backward call; delta (B,H,T) = rowsum(dout * out) is computed first
// (delta_row) into workspace.
template <typename T>
struct BackwardArgs {
  Geometry geo;
  const T *q, *k, *v, *out, *dout;
  const int32_t* seg_start;  // (B,T)
  const float* lse;          // (B,H,T)
  const float* delta;        // (B,H,T)
  float scale;
  T *dq, *dk, *dv;
};

// rowsum(dout * out) of one (b, t, h) row of D values.
template <typename T>
POLLEN_HD float delta_row(const T* dout, const T* out, int64_t dim) {
  float sum = 0.0f;
  for (int64_t d = 0; d < dim; ++d) sum += Element<T>::load(dout[d]) * Element<T>::load(out[d]);
  return sum;
}

// delta of row `row` (B*T*H rows in q order) into delta (B,H,T); one GPU thread per row.
template <typename T>
POLLEN_HD void delta_for_row(const BackwardArgs<T>& a, int64_t row, float* delta) {
  const AttentionShape& s = a.geo.s;
  const int64_t h = row % s.heads, bt = row / s.heads, t = bt % s.seq, b = bt / s.seq;
  const int64_t at = row * s.head_dim;
  delta[a.geo.row_at(b, h, t)] = delta_row(a.dout + at, a.out + at, s.head_dim);
}

// ---- shared memory ---------------------------------------------------------------------------

// Row tiles (kTile, D + 1) hold kTile rows of one head, converted to float (+1: no bank
// conflicts when a warp reads down a column).
template <int D>
constexpr int kRow = D + 1;
template <int D>
constexpr int kRowTile = kTile* kRow<D>;

template <int D>
struct ForwardSmem {
  static constexpr size_t kFloats = 3 * kRowTile<D> + kTile * kScoreRow + 4 * kTile;
  static constexpr size_t kBytes = kFloats * sizeof(float);
  POLLEN_HD explicit ForwardSmem(float* base)
      : q(base),
        k(q + kRowTile<D>),
        v(k + kRowTile<D>),
        probs(v + kRowTile<D>),
        row_max(probs + kTile * kScoreRow),
        row_sum(row_max + kTile),
        row_rescale(row_sum + kTile),
        seg(reinterpret_cast<int32_t*>(row_rescale + kTile)) {}
  float* q;            // (kTile, D+1) q * scale
  float* k;            // (kTile, D+1)
  float* v;            // (kTile, D+1)
  float* probs;        // (kTile, kTile+1) scores, then exp(score - row_max)
  float* row_max;      // (kTile) online softmax state
  float* row_sum;      // (kTile)
  float* row_rescale;  // (kTile) this key tile's softmax_rescale
  int32_t* seg;        // (kTile) seg_start of the tile's queries
};

template <int D>
struct BackwardSmem {
  static constexpr size_t kFloats = 4 * kRowTile<D> + 2 * kTile * kScoreRow + 3 * kTile;
  static constexpr size_t kBytes = kFloats * sizeof(float);
  POLLEN_HD explicit BackwardSmem(float* base)
      : q(base),
        dout(q + kRowTile<D>),
        k(dout + kRowTile<D>),
        v(k + kRowTile<D>),
        probs(v + kRowTile<D>),
        dscores(probs + kTile * kScoreRow),
        lse(dscores + kTile * kScoreRow),
        delta(lse + kTile),
        seg(reinterpret_cast<int32_t*>(delta + kTile)) {}
  float* q;        // (kTile, D+1) q * scale
  float* dout;     // (kTile, D+1)
  float* k;        // (kTile, D+1)
  float* v;        // (kTile, D+1)
  float* probs;    // (kTile, kTile+1) P
  float* dscores;  // (kTile, kTile+1) dS
  float* lse;      // (kTile) of the tile's queries
  float* delta;    // (kTile)
  int32_t* seg;    // (kTile)
};

// Per-thread accumulators (registers on the GPU): rows lane_row + kLanes * i, columns
// lane_col + kLanes * c of a (kTile, D) tile.
template <int D>
struct Accumulator {
  static constexpr int kCols = D / kLanes;
  float v[kMicro][kCols];
  POLLEN_HD void zero() {
    POLLEN_UNROLL
    for (int i = 0; i < kMicro; ++i) {
      POLLEN_UNROLL
      for (int c = 0; c < kCols; ++c) v[i][c] = 0.0f;
    }
  }
};

// ---- phases: each is run by every thread of a block between two barriers ---------------------

// Rows [row0, row0 + rows) of a head, `stride` elements apart, times factor, into a row tile;
// rows past `rows` are zero.
template <int D, typename T>
POLLEN_HD void load_rows(int tid, const T* src, int64_t stride, int64_t rows, float factor,
                         float* tile) {
  for (int e = tid; e < kTile * D; e += kAttentionThreads) {
    const int r = e / D, d = e % D;
    tile[r * kRow<D> + d] = r < rows ? Element<T>::load(src[r * stride + d]) * factor : 0.0f;
  }
}

// S (kTile, kTile) micro tile of this thread: a (kTile, D+1) times b (kTile, D+1) transposed.
template <int D>
POLLEN_HD void micro_scores(int tid, const float* a, const float* b, float s[kMicro][kMicro]) {
  const int r0 = lane_row(tid), c0 = lane_col(tid);
  POLLEN_UNROLL
  for (int i = 0; i < kMicro; ++i) {
    POLLEN_UNROLL
    for (int j = 0; j < kMicro; ++j) s[i][j] = 0.0f;
  }
  for (int d = 0; d < D; ++d) {
    float ai[kMicro], bj[kMicro];
    POLLEN_UNROLL
    for (int i = 0; i < kMicro; ++i) ai[i] = a[(r0 + kLanes * i) * kRow<D> + d];
    POLLEN_UNROLL
    for (int j = 0; j < kMicro; ++j) bj[j] = b[(c0 + kLanes * j) * kRow<D> + d];
    POLLEN_UNROLL
    for (int i = 0; i < kMicro; ++i) {
      POLLEN_UNROLL
      for (int j = 0; j < kMicro; ++j) s[i][j] += ai[i] * bj[j];
    }
  }
}

// acc (kTile, D) += p (kTile, kTile+1) . m (kTile, D+1), or with kTransposeP, p^T . m.
template <int D, bool kTransposeP>
POLLEN_HD void micro_accumulate(int tid, const float* p, const float* m, Accumulator<D>& acc) {
  const int r0 = lane_row(tid), c0 = lane_col(tid);
  for (int j = 0; j < kTile; ++j) {
    float pj[kMicro], mj[Accumulator<D>::kCols];
    POLLEN_UNROLL
    for (int i = 0; i < kMicro; ++i) {
      const int r = r0 + kLanes * i;
      pj[i] = kTransposeP ? p[j * kScoreRow + r] : p[r * kScoreRow + j];
    }
    POLLEN_UNROLL
    for (int c = 0; c < Accumulator<D>::kCols; ++c) mj[c] = m[j * kRow<D> + c0 + kLanes * c];
    POLLEN_UNROLL
    for (int i = 0; i < kMicro; ++i) {
      POLLEN_UNROLL
      for (int c = 0; c < Accumulator<D>::kCols; ++c) acc.v[i][c] += pj[i] * mj[c];
    }
  }
}

// Writes acc * row_factor[row] * factor to rows [0, rows) of a head in device memory.
template <int D, typename T>
POLLEN_HD void store_rows(int tid, const Accumulator<D>& acc, const float* row_factor, float factor,
                          int64_t rows, int64_t stride, T* dst) {
  const int r0 = lane_row(tid), c0 = lane_col(tid);
  POLLEN_UNROLL
  for (int i = 0; i < kMicro; ++i) {
    const int r = r0 + kLanes * i;
    if (r >= rows) continue;
    const float f = (row_factor ? row_factor[r] : 1.0f) * factor;
    POLLEN_UNROLL
    for (int c = 0; c < Accumulator<D>::kCols; ++c)
      dst[r * stride + c0 + kLanes * c] = Element<T>::store(acc.v[i][c] * f);
  }
}

// The query side of a backward tile: q * scale, dout, lse, delta and seg_start of queries
// [query0, query0 + rows) of head h.
template <int D, typename T>
POLLEN_HD void load_query_side(int tid, const BackwardArgs<T>& a, int64_t b, int64_t h,
                               int64_t query0, int64_t rows, const BackwardSmem<D>& sm) {
  const Geometry& g = a.geo;
  const int64_t stride = g.s.heads * D;
  load_rows<D>(tid, a.q + g.q_at(b, query0, h), stride, rows, a.scale, sm.q);
  load_rows<D>(tid, a.dout + g.q_at(b, query0, h), stride, rows, 1.0f, sm.dout);
  if (tid < kTile) {
    const bool in = tid < rows;
    sm.lse[tid] = in ? a.lse[g.row_at(b, h, query0 + tid)] : 0.0f;
    sm.delta[tid] = in ? a.delta[g.row_at(b, h, query0 + tid)] : 0.0f;
    sm.seg[tid] = in ? a.seg_start[b * g.s.seq + query0 + tid] : 0;
  }
}

// P = exp(q k^T * scale - lse) and dS = P * (dout v^T - delta) of this thread's micro tile, zero
// where query query0 + r (r < rows) does not see key key0 + j.
template <int D>
POLLEN_HD void probs_and_dscores(int tid, const BackwardSmem<D>& sm, int64_t query0, int64_t rows,
                                 int64_t key0) {
  float s[kMicro][kMicro], dp[kMicro][kMicro];
  micro_scores<D>(tid, sm.q, sm.k, s);
  micro_scores<D>(tid, sm.dout, sm.v, dp);
  const int r0 = lane_row(tid), c0 = lane_col(tid);
  POLLEN_UNROLL
  for (int i = 0; i < kMicro; ++i) {
    const int r = r0 + kLanes * i;
    POLLEN_UNROLL
    for (int j = 0; j < kMicro; ++j) {
      const int c = c0 + kLanes * j;
      const bool visible = r < rows && key_visible(sm.seg[r], query0 + r, key0 + c);
      const float p = visible ? expf(s[i][j] - sm.lse[r]) : 0.0f;
      sm.probs[r * kScoreRow + c] = p;
      sm.dscores[r * kScoreRow + c] = visible ? score_gradient(p, dp[i][j], sm.delta[r]) : 0.0f;
    }
  }
}

// ---- blocks ----------------------------------------------------------------------------------

// Forward grid: x = query tile, y = b * H + h.
template <int D, typename T, typename Block>
POLLEN_HD void forward_block(Block& block, const ForwardArgs<T>& a, int64_t query_tile, int64_t bh,
                             float* smem_base) {
  const Geometry& g = a.geo;
  const QueryTileAt at = query_tile_at(g, query_tile, bh);
  const int64_t seq = g.s.seq, b = at.b, h = at.h, kv = at.kv, query0 = at.query0, rows = at.rows;
  const int32_t* seg = a.seg_start + b * seq;
  const ForwardSmem<D> sm(smem_base);

  block.run([&](int tid, Accumulator<D>& out) {
    load_rows<D>(tid, a.q + g.q_at(b, query0, h), g.s.heads * D, rows, a.scale, sm.q);
    if (tid < kTile) {
      sm.row_max[tid] = -INFINITY;
      sm.row_sum[tid] = 0.0f;
      sm.seg[tid] = tid < rows ? seg[query0 + tid] : 0;
    }
    out.zero();
  });
  const TileRange keys = key_tiles_for_queries(seg[query0], query0, rows);
  for (int64_t key_tile = keys.first; key_tile < keys.end; ++key_tile) {
    const int64_t key0 = key_tile * kTile;
    const int64_t key_rows = tile_rows(seq, key0);
    block.run([&](int tid, Accumulator<D>&) {
      load_rows<D>(tid, a.k + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, 1.0f, sm.k);
      load_rows<D>(tid, a.v + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, 1.0f, sm.v);
    });
    // scores, -inf where not visible
    block.run([&](int tid, Accumulator<D>&) {
      float s[kMicro][kMicro];
      micro_scores<D>(tid, sm.q, sm.k, s);
      POLLEN_UNROLL
      for (int i = 0; i < kMicro; ++i) {
        const int r = lane_row(tid) + kLanes * i;
        POLLEN_UNROLL
        for (int j = 0; j < kMicro; ++j) {
          const int c = lane_col(tid) + kLanes * j;
          const bool visible = r < rows && key_visible(sm.seg[r], query0 + r, key0 + c);
          sm.probs[r * kScoreRow + c] = visible ? s[i][j] : -INFINITY;
        }
      }
    });
    // online softmax, one thread per query row
    block.run([&](int tid, Accumulator<D>&) {
      if (tid >= kTile) return;
      float* row = sm.probs + tid * kScoreRow;
      float tile_max = -INFINITY;
      for (int j = 0; j < kTile; ++j) tile_max = row[j] > tile_max ? row[j] : tile_max;
      const float old_max = sm.row_max[tid];
      const float new_max = tile_max > old_max ? tile_max : old_max;
      float sum = 0.0f;
      for (int j = 0; j < kTile; ++j) {
        row[j] = shifted_exp(row[j], new_max);
        sum += row[j];
      }
      const float rescale = softmax_rescale(old_max, new_max);
      sm.row_rescale[tid] = rescale;
      sm.row_sum[tid] = sm.row_sum[tid] * rescale + sum;
      sm.row_max[tid] = new_max;
    });
    // out = out * rescale + P v
    block.run([&](int tid, Accumulator<D>& out) {
      POLLEN_UNROLL
      for (int i = 0; i < kMicro; ++i) {
        const float rescale = sm.row_rescale[lane_row(tid) + kLanes * i];
        POLLEN_UNROLL
        for (int c = 0; c < Accumulator<D>::kCols; ++c) out.v[i][c] *= rescale;
      }
      micro_accumulate<D, false>(tid, sm.probs, sm.v, out);
    });
  }
  block.run([&](int tid, Accumulator<D>&) {
    if (tid < rows) {
      sm.row_rescale[tid] = 1.0f / sm.row_sum[tid];
      a.lse[g.row_at(b, h, query0 + tid)] = row_lse(sm.row_max[tid], sm.row_sum[tid]);
    }
  });
  block.run([&](int tid, Accumulator<D>& out) {
    store_rows<D>(tid, out, sm.row_rescale, 1.0f, rows, g.s.heads * D,
                  a.out + g.q_at(b, query0, h));
  });
}

// dq grid: x = query tile, y = b * H + h. dq = scale * sum over key tiles of dS k.
template <int D, typename T, typename Block>
POLLEN_HD void backward_dq_block(Block& block, const BackwardArgs<T>& a, int64_t query_tile,
                                 int64_t bh, float* smem_base) {
  const Geometry& g = a.geo;
  const QueryTileAt at = query_tile_at(g, query_tile, bh);
  const int64_t seq = g.s.seq, b = at.b, h = at.h, kv = at.kv, query0 = at.query0, rows = at.rows;
  const BackwardSmem<D> sm(smem_base);

  block.run([&](int tid, Accumulator<D>& dq) {
    load_query_side<D>(tid, a, b, h, query0, rows, sm);
    dq.zero();
  });
  const TileRange keys = key_tiles_for_queries(a.seg_start[b * seq + query0], query0, rows);
  for (int64_t key_tile = keys.first; key_tile < keys.end; ++key_tile) {
    const int64_t key0 = key_tile * kTile;
    const int64_t key_rows = tile_rows(seq, key0);
    block.run([&](int tid, Accumulator<D>&) {
      load_rows<D>(tid, a.k + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, 1.0f, sm.k);
      load_rows<D>(tid, a.v + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, 1.0f, sm.v);
    });
    block.run([&](int tid, Accumulator<D>&) { probs_and_dscores<D>(tid, sm, query0, rows, key0); });
    block.run([&](int tid, Accumulator<D>& dq) {
      micro_accumulate<D, false>(tid, sm.dscores, sm.k, dq);
    });
  }
  block.run([&](int tid, Accumulator<D>& dq) {
    store_rows<D>(tid, dq, nullptr, a.scale, rows, g.s.heads * D, a.dq + g.q_at(b, query0, h));
  });
}

// dk, dv grid: x = key tile, y = b * KVH + kv. Visits every query head reading kv head kv and
// the query tiles [key0, query_end) that see the key tile; dk, dv stay in registers.
template <int D>
struct DkDv {
  Accumulator<D> dk, dv;
};

template <int D, typename T, typename Block>
POLLEN_HD void backward_dkdv_block(Block& block, const BackwardArgs<T>& a, int64_t key_tile,
                                   int64_t bkv, float* smem_base) {
  const Geometry& g = a.geo;
  const int64_t seq = g.s.seq, b = bkv / g.s.kv_heads, kv = bkv % g.s.kv_heads;
  const int64_t key0 = key_tile * kTile;
  const int64_t key_rows = tile_rows(seq, key0);
  const BackwardSmem<D> sm(smem_base);

  block.run([&](int tid, DkDv<D>& acc) {
    load_rows<D>(tid, a.k + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, 1.0f, sm.k);
    load_rows<D>(tid, a.v + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, 1.0f, sm.v);
    acc.dk.zero();
    acc.dv.zero();
  });
  const int64_t query_end = query_end_for_keys(a.seg_start + b * seq, seq, key0, key_rows);
  for (int64_t member = 0; member < g.group(); ++member) {
    const int64_t h = kv * g.group() + member;
    for (int64_t query0 = key0; query0 < query_end; query0 += kTile) {
      const int64_t rows = tile_rows(query_end, query0);
      block.run([&](int tid, DkDv<D>&) { load_query_side<D>(tid, a, b, h, query0, rows, sm); });
      block.run([&](int tid, DkDv<D>&) { probs_and_dscores<D>(tid, sm, query0, rows, key0); });
      // dv += P^T dout; dk += dS^T (q * scale)
      block.run([&](int tid, DkDv<D>& acc) {
        micro_accumulate<D, true>(tid, sm.probs, sm.dout, acc.dv);
        micro_accumulate<D, true>(tid, sm.dscores, sm.q, acc.dk);
      });
    }
  }
  block.run([&](int tid, DkDv<D>& acc) {
    const int64_t stride = g.s.kv_heads * D;
    store_rows<D>(tid, acc.dk, nullptr, 1.0f, key_rows, stride, a.dk + g.kv_at(b, key0, kv));
    store_rows<D>(tid, acc.dv, nullptr, 1.0f, key_rows, stride, a.dv + g.kv_at(b, key0, kv));
  });
}

}  // namespace pollen::ops::cuda
