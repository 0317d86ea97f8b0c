#pragma once
// bf16 attention on the tensor cores: the block functions of the kernels attention.cu runs for
// bf16 (f32 keeps the CUDA-core kernels of attention_tiles.h), written once for the GPU and the
// CPU as those are, with the same grids, (64,64) tiles, tile schedule, masks and online softmax.
//
// What changes is where the products run. S = q k^T, dP = dout v^T, out += P v, dq += dS k,
// dk += dS^T q and dv += P^T dout are warp products of (16,16) bf16 tiles in shared memory with
// fp32 accumulation (warp_mma.h), as in FlashAttention: q, k, v and dout are bf16 already, P and
// dS are rounded to bf16 for the products they feed, and the softmax, its statistics and every
// sum over tiles stay fp32. The scale multiplies S (not q), and dq and dk on their way out.
//
// The eight warps of a block share each product: a (64,64) score tile is 4 x 4 tiles of (16,16),
// two per warp; a (64,D) output is 4 x D/16 tiles, D/32 per warp (warp w: tiles w, w + 8, ...).
// The forward keeps its output in shared memory, where the online softmax rescales it row by row
// between products; the backward's dq, dk and dv stay in the warps' accumulators across tiles.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "ops/cuda/attention_tiles.h"
#include "ops/cuda/warp_mma.h"

namespace pollen::ops::cuda {

static_assert(kTile == 4 * kMmaTile && kAttentionThreads == 8 * kWarpSize,
              "the warp schedule below assumes (64,64) tiles and eight warps");

// Leading dimensions (elements) of the shared-memory tiles; each row ends 16 bytes past its data
// so that a warp's rows fall on different banks, and stays a multiple of 16 bytes for WMMA.
template <int D>
constexpr int kMmaRowLd = D + 8;        // bf16 (kTile, D): q, k, v, dout
constexpr int kMmaScoreLd = kTile + 4;  // f32 (kTile, kTile): S, dP
constexpr int kMmaProbLd = kTile + 8;   // bf16 (kTile, kTile): P, dS
template <int D>
constexpr int kMmaOutLd = D + 4;  // f32 (kTile, D): the forward's output, outputs on their way out

// Each region of shared memory starts 128 bytes past the previous one's end (WMMA needs 32).
POLLEN_HD constexpr size_t mma_region(size_t bytes) {
  return (bytes + 127) / 128 * 128;
}

// Hands out the regions of a block's shared memory in order.
struct SmemRegions {
  char* next;
  template <typename E>
  POLLEN_HD E* take(size_t count) {
    E* p = reinterpret_cast<E*>(next);
    next += mma_region(count * sizeof(E));
    return p;
  }
};

template <int D>
constexpr size_t kMmaRowTileBytes = mma_region(kTile* kMmaRowLd<D> * 2);
constexpr size_t kMmaScoreTileBytes = mma_region(kTile * kMmaScoreLd * 4);
constexpr size_t kMmaProbTileBytes = mma_region(kTile * kMmaProbLd * 2);
template <int D>
constexpr size_t kMmaOutTileBytes = mma_region(kTile* kMmaOutLd<D> * 4);
constexpr size_t kMmaRowStatBytes = mma_region(kTile * 4);
constexpr size_t kMmaRowQuarterBytes = mma_region(kTile * 4 * 4);

// The forward's softmax runs on all threads: thread tid takes row tid / 4 and its quarter tid % 4
// of the columns (and of the output's columns when rescaling).
constexpr int kRowQuarters = kAttentionThreads / kTile;
static_assert(kRowQuarters == 4, "four threads per query row");

template <int D>
struct MmaForwardSmem {
  static constexpr size_t kBytes = 3 * kMmaRowTileBytes<D> + kMmaScoreTileBytes +
                                   kMmaProbTileBytes + kMmaOutTileBytes<D> + 3 * kMmaRowStatBytes +
                                   2 * kMmaRowQuarterBytes + kMmaRowStatBytes;
  POLLEN_HD explicit MmaForwardSmem(void* base) {
    SmemRegions r{static_cast<char*>(base)};
    q = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    k = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    v = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    scores = r.take<float>(kTile * kMmaScoreLd);
    probs = r.take<MmaBf16>(kTile * kMmaProbLd);
    out = r.take<float>(kTile * kMmaOutLd<D>);
    row_max = r.take<float>(kTile);
    row_sum = r.take<float>(kTile);
    row_inv_sum = r.take<float>(kTile);
    quarter_max = r.take<float>(kTile * kRowQuarters);
    quarter_sum = r.take<float>(kTile * kRowQuarters);
    seg = r.take<int32_t>(kTile);
  }
  MmaBf16 *q, *k, *v;        // (kTile, D)
  float* scores;             // (kTile, kTile) q k^T, then scale * (q k^T), -inf where not visible
  MmaBf16* probs;            // (kTile, kTile) exp(score - row_max)
  float* out;                // (kTile, D) the unnormalised output
  float *row_max, *row_sum;  // (kTile) online softmax state
  float* row_inv_sum;        // (kTile) 1 / row_sum, at the end
  float *quarter_max, *quarter_sum;  // (kTile, 4) this key tile's, per quarter of a row
  int32_t* seg;                      // (kTile) seg_start of the tile's queries
};

template <int D>
struct MmaBackwardSmem {
  static constexpr size_t kBytes = 4 * kMmaRowTileBytes<D> + 2 * kMmaScoreTileBytes +
                                   2 * kMmaProbTileBytes + kMmaOutTileBytes<D> +
                                   3 * kMmaRowStatBytes;
  POLLEN_HD explicit MmaBackwardSmem(void* base) {
    SmemRegions r{static_cast<char*>(base)};
    q = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    dout = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    k = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    v = r.take<MmaBf16>(kTile * kMmaRowLd<D>);
    scores = r.take<float>(kTile * kMmaScoreLd);
    dprobs = r.take<float>(kTile * kMmaScoreLd);
    probs = r.take<MmaBf16>(kTile * kMmaProbLd);
    dscores = r.take<MmaBf16>(kTile * kMmaProbLd);
    stage = r.take<float>(kTile * kMmaOutLd<D>);
    lse = r.take<float>(kTile);
    delta = r.take<float>(kTile);
    seg = r.take<int32_t>(kTile);
  }
  MmaBf16 *q, *dout, *k, *v;  // (kTile, D)
  float *scores, *dprobs;     // (kTile, kTile) q k^T and dout v^T
  MmaBf16 *probs, *dscores;   // (kTile, kTile) P and dS, zero where not visible
  float* stage;               // (kTile, D) an accumulator on its way to device memory
  float *lse, *delta;         // (kTile) of the tile's queries
  int32_t* seg;               // (kTile)
};

// Per-thread state of the kernels: none for the forward; the backward's accumulators (on the
// CPU lane 0's hold the warp's tiles).
struct MmaNoState {
  float unused;
};
template <int D>
struct MmaDq {
  MmaAccumulator dq[D / 32];
};
template <int D>
struct MmaDkDv {
  MmaAccumulator dk[D / 32], dv[D / 32];
};

// ---- phases ----------------------------------------------------------------------------------

// A row's running maximum after a key tile whose quarters' maxima are quarter_max[0..4).
POLLEN_HD float row_max_after(float old_max, const float* quarter_max) {
  float m = old_max;
  for (int q = 0; q < kRowQuarters; ++q) m = quarter_max[q] > m ? quarter_max[q] : m;
  return m;
}

// Rows [0, rows) of a head, `stride` elements apart, into a bf16 row tile; rows past `rows` are
// zero. Each thread moves eight elements (16 bytes of bf16) at a time.
template <int D, typename T>
POLLEN_HD void load_rows_bf16(int tid, const T* src, int64_t stride, int64_t rows, MmaBf16* tile) {
  constexpr int kPerRow = D / kBf16PerCopy;
  for (int e = tid; e < kTile * kPerRow; e += kAttentionThreads) {
    const int r = e / kPerRow, d = e % kPerRow * kBf16PerCopy;
    copy_to_bf16(r < rows ? src + r * stride + d : nullptr, tile + r * kMmaRowLd<D> + d);
  }
}

// s (kTile, kTile) f32 = a (kTile, D) b (kTile, D)^T; warp w computes tiles 2w and 2w + 1.
template <int D>
POLLEN_HD void warp_scores(int tid, const MmaBf16* a, const MmaBf16* b, float* s) {
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  POLLEN_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int t = 2 * warp + i, row_block = t / 4, col_block = t % 4;
    MmaAccumulator acc;
    mma_zero(lane, acc);
    POLLEN_UNROLL
    for (int k0 = 0; k0 < D; k0 += kMmaTile) {
      // b^T is b read column-major: b^T(k, n) = b[n][k].
      mma<false, true>(lane, acc, a + row_block * kMmaTile * kMmaRowLd<D> + k0, kMmaRowLd<D>,
                       b + col_block * kMmaTile * kMmaRowLd<D> + k0, kMmaRowLd<D>);
    }
    mma_store(lane, s + row_block * kMmaTile * kMmaScoreLd + col_block * kMmaTile, acc,
              kMmaScoreLd);
  }
}

// Where output tile i of this warp lies in a (kTile, D) output: its row and column blocks.
template <int D>
POLLEN_HD int out_row_block(int warp, int i) {
  return (warp + 8 * i) / (D / kMmaTile);
}
template <int D>
POLLEN_HD int out_col_block(int warp, int i) {
  return (warp + 8 * i) % (D / kMmaTile);
}

// acc (the warp's output tile i) += p m, or with kTransposeP p^T m: p (kTile, kTile) bf16 with
// rows of queries and columns of keys, m (kTile, D) bf16.
template <int D, bool kTransposeP>
POLLEN_HD void warp_accumulate(int lane, int warp, int i, MmaAccumulator& acc, const MmaBf16* p,
                               const MmaBf16* m) {
  const int row_block = out_row_block<D>(warp, i), col_block = out_col_block<D>(warp, i);
  POLLEN_UNROLL
  for (int k0 = 0; k0 < kTile; k0 += kMmaTile) {
    // p^T is p read column-major: p^T(r, k) = p[k][r].
    const MmaBf16* a = kTransposeP ? p + k0 * kMmaProbLd + row_block * kMmaTile
                                   : p + row_block * kMmaTile * kMmaProbLd + k0;
    mma<kTransposeP, false>(lane, acc, a, kMmaProbLd, m + k0 * kMmaRowLd<D> + col_block * kMmaTile,
                            kMmaRowLd<D>);
  }
}

// The warp's output tile i of a (kTile, D) f32 tile with leading dimension kMmaOutLd<D>.
template <int D>
POLLEN_HD float* out_tile(float* base, int warp, int i) {
  return base + out_row_block<D>(warp, i) * kMmaTile * kMmaOutLd<D> +
         out_col_block<D>(warp, i) * kMmaTile;
}

// Rows [0, rows) of stage (kTile, D) f32, times row_factor[row] (when given) and factor, to a
// head in device memory, rows `stride` elements apart.
template <int D, typename T>
POLLEN_HD void store_stage(int tid, const float* stage, const float* row_factor, float factor,
                           int64_t rows, int64_t stride, T* dst) {
  for (int e = tid; e < rows * D; e += kAttentionThreads) {
    const int r = e / D, d = e % D;
    const float f = (row_factor ? row_factor[r] : 1.0f) * factor;
    dst[r * stride + d] = Element<T>::store(stage[r * kMmaOutLd<D> + d] * f);
  }
}

// The query side of a backward tile: q, dout, lse, delta and seg_start of queries
// [query0, query0 + rows) of head h.
template <int D, typename T>
POLLEN_HD void load_query_side_bf16(int tid, const BackwardArgs<T>& a, int64_t b, int64_t h,
                                    int64_t query0, int64_t rows, const MmaBackwardSmem<D>& sm) {
  const Geometry& g = a.geo;
  const int64_t stride = g.s.heads * D;
  load_rows_bf16<D>(tid, a.q + g.q_at(b, query0, h), stride, rows, sm.q);
  load_rows_bf16<D>(tid, a.dout + g.q_at(b, query0, h), stride, rows, sm.dout);
  if (tid < kTile) {
    const bool in = tid < rows;
    sm.lse[tid] = in ? a.lse[g.row_at(b, h, query0 + tid)] : 0.0f;
    sm.delta[tid] = in ? a.delta[g.row_at(b, h, query0 + tid)] : 0.0f;
    sm.seg[tid] = in ? a.seg_start[b * g.s.seq + query0 + tid] : 0;
  }
}

// P = exp(scale * S - lse) and dS = P * (dP - delta) from the scores and dprobs tiles, in bf16,
// zero where query query0 + r (r < rows) does not see key key0 + c.
template <int D>
POLLEN_HD void probs_and_dscores_bf16(int tid, const MmaBackwardSmem<D>& sm, float scale,
                                      int64_t query0, int64_t rows, int64_t key0) {
  for (int e = tid; e < kTile * kTile; e += kAttentionThreads) {
    const int r = e / kTile, c = e % kTile;
    const bool visible = r < rows && key_visible(sm.seg[r], query0 + r, key0 + c);
    const float p = visible ? expf(sm.scores[r * kMmaScoreLd + c] * scale - sm.lse[r]) : 0.0f;
    const float ds =
        visible ? score_gradient(p, sm.dprobs[r * kMmaScoreLd + c], sm.delta[r]) : 0.0f;
    sm.probs[r * kMmaProbLd + c] = to_mma_bf16(p);
    sm.dscores[r * kMmaProbLd + c] = to_mma_bf16(ds);
  }
}

// The backward's two phases per (query tile, key tile): S = q k^T and dP = dout v^T on the tensor
// cores, then P and dS in bf16 from them.
template <int D, typename Block>
POLLEN_HD void backward_tile_phases(Block& block, const MmaBackwardSmem<D>& sm, float scale,
                                    int64_t query0, int64_t rows, int64_t key0) {
  block.run([&](int tid, auto&) {
    warp_scores<D>(tid, sm.q, sm.k, sm.scores);
    warp_scores<D>(tid, sm.dout, sm.v, sm.dprobs);
  });
  block.run([&](int tid, auto&) { probs_and_dscores_bf16<D>(tid, sm, scale, query0, rows, key0); });
}

// The warps' accumulators of a (kTile, D) output, as `pick` selects them from a thread's state,
// through the stage tile to rows [0, rows) of a head in device memory, times factor.
template <int D, typename Block, typename Pick, typename T>
POLLEN_HD void store_accumulators(Block& block, Pick pick, float* stage, float factor, int64_t rows,
                                  int64_t stride, T* dst) {
  block.run([&](int tid, auto& st) {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    const MmaAccumulator* acc = pick(st);
    POLLEN_UNROLL
    for (int i = 0; i < D / 32; ++i)
      mma_store(lane, out_tile<D>(stage, warp, i), acc[i], kMmaOutLd<D>);
  });
  block.run(
      [&](int tid, auto&) { store_stage<D>(tid, stage, nullptr, factor, rows, stride, dst); });
}

// ---- blocks ----------------------------------------------------------------------------------

// Forward grid: x = query tile, y = b * H + h.
template <int D, typename T, typename Block>
POLLEN_HD void mma_forward_block(Block& block, const ForwardArgs<T>& a, int64_t query_tile,
                                 int64_t bh, void* smem_base) {
  const Geometry& g = a.geo;
  const QueryTileAt at = query_tile_at(g, query_tile, bh);
  const int64_t seq = g.s.seq, b = at.b, h = at.h, kv = at.kv, query0 = at.query0, rows = at.rows;
  const int32_t* seg = a.seg_start + b * seq;
  const MmaForwardSmem<D> sm(smem_base);

  block.run([&](int tid, MmaNoState&) {
    load_rows_bf16<D>(tid, a.q + g.q_at(b, query0, h), g.s.heads * D, rows, sm.q);
    for (int e = tid; e < kTile * kMmaOutLd<D>; e += kAttentionThreads) sm.out[e] = 0.0f;
    if (tid < kTile) {
      sm.row_max[tid] = -INFINITY;
      sm.row_sum[tid] = 0.0f;
      sm.seg[tid] = tid < rows ? seg[query0 + tid] : 0;
    }
  });
  const TileRange keys = key_tiles_for_queries(seg[query0], query0, rows);
  for (int64_t key_tile = keys.first; key_tile < keys.end; ++key_tile) {
    const int64_t key0 = key_tile * kTile;
    const int64_t key_rows = tile_rows(seq, key0);
    block.run([&](int tid, MmaNoState&) {
      load_rows_bf16<D>(tid, a.k + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, sm.k);
      load_rows_bf16<D>(tid, a.v + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, sm.v);
    });
    block.run([&](int tid, MmaNoState&) { warp_scores<D>(tid, sm.q, sm.k, sm.scores); });
    // online softmax, four threads per query row: the scaled, masked scores and their maximum
    // per quarter of the row
    block.run([&](int tid, MmaNoState&) {
      const int r = tid / kRowQuarters, first = tid % kRowQuarters * (kTile / kRowQuarters);
      float* row = sm.scores + r * kMmaScoreLd;
      float quarter_max = -INFINITY;
      for (int j = first; j < first + kTile / kRowQuarters; ++j) {
        const bool visible = r < rows && key_visible(sm.seg[r], query0 + r, key0 + j);
        row[j] = visible ? row[j] * a.scale : -INFINITY;
        quarter_max = row[j] > quarter_max ? row[j] : quarter_max;
      }
      sm.quarter_max[tid] = quarter_max;
    });
    // P = exp(score - the row's new maximum) and its sum per quarter; the output's quarter of the
    // row rescaled to the new maximum
    block.run([&](int tid, MmaNoState&) {
      const int r = tid / kRowQuarters, quarter = tid % kRowQuarters;
      const float old_max = sm.row_max[r];
      const float new_max = row_max_after(old_max, sm.quarter_max + r * kRowQuarters);
      const int first = quarter * (kTile / kRowQuarters);
      float sum = 0.0f;
      for (int j = first; j < first + kTile / kRowQuarters; ++j) {
        const float p = shifted_exp(sm.scores[r * kMmaScoreLd + j], new_max);
        sm.probs[r * kMmaProbLd + j] = to_mma_bf16(p);
        sum += p;
      }
      sm.quarter_sum[tid] = sum;
      const float rescale = softmax_rescale(old_max, new_max);
      float* out_row = sm.out + r * kMmaOutLd<D>;
      for (int d = quarter * (D / kRowQuarters); d < (quarter + 1) * (D / kRowQuarters); ++d)
        out_row[d] *= rescale;
    });
    // out += P v; the rows' softmax state moves on to this key tile
    block.run([&](int tid, MmaNoState&) {
      const int warp = tid / kWarpSize, lane = tid % kWarpSize;
      POLLEN_UNROLL
      for (int i = 0; i < D / 32; ++i) {
        float* tile = out_tile<D>(sm.out, warp, i);
        MmaAccumulator acc;
        mma_load(lane, acc, tile, kMmaOutLd<D>);
        warp_accumulate<D, false>(lane, warp, i, acc, sm.probs, sm.v);
        mma_store(lane, tile, acc, kMmaOutLd<D>);
      }
      if (tid < kTile) {
        const float old_max = sm.row_max[tid];
        const float new_max = row_max_after(old_max, sm.quarter_max + tid * kRowQuarters);
        const float* sums = sm.quarter_sum + tid * kRowQuarters;
        sm.row_sum[tid] = sm.row_sum[tid] * softmax_rescale(old_max, new_max) +
                          (sums[0] + sums[1]) + (sums[2] + sums[3]);
        sm.row_max[tid] = new_max;
      }
    });
  }
  block.run([&](int tid, MmaNoState&) {
    if (tid < rows) {
      sm.row_inv_sum[tid] = 1.0f / sm.row_sum[tid];
      a.lse[g.row_at(b, h, query0 + tid)] = row_lse(sm.row_max[tid], sm.row_sum[tid]);
    }
  });
  block.run([&](int tid, MmaNoState&) {
    store_stage<D>(tid, sm.out, sm.row_inv_sum, 1.0f, rows, g.s.heads * D,
                   a.out + g.q_at(b, query0, h));
  });
}

// dq grid: x = query tile, y = b * H + h. dq = scale * sum over key tiles of dS k.
template <int D, typename T, typename Block>
POLLEN_HD void mma_backward_dq_block(Block& block, const BackwardArgs<T>& a, int64_t query_tile,
                                     int64_t bh, void* smem_base) {
  const Geometry& g = a.geo;
  const QueryTileAt at = query_tile_at(g, query_tile, bh);
  const int64_t seq = g.s.seq, b = at.b, h = at.h, kv = at.kv, query0 = at.query0, rows = at.rows;
  const MmaBackwardSmem<D> sm(smem_base);

  block.run([&](int tid, MmaDq<D>& st) {
    load_query_side_bf16<D>(tid, a, b, h, query0, rows, sm);
    POLLEN_UNROLL
    for (int i = 0; i < D / 32; ++i) mma_zero(tid % kWarpSize, st.dq[i]);
  });
  const TileRange keys = key_tiles_for_queries(a.seg_start[b * seq + query0], query0, rows);
  for (int64_t key_tile = keys.first; key_tile < keys.end; ++key_tile) {
    const int64_t key0 = key_tile * kTile;
    const int64_t key_rows = tile_rows(seq, key0);
    block.run([&](int tid, MmaDq<D>&) {
      load_rows_bf16<D>(tid, a.k + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, sm.k);
      load_rows_bf16<D>(tid, a.v + g.kv_at(b, key0, kv), g.s.kv_heads * D, key_rows, sm.v);
    });
    backward_tile_phases<D>(block, sm, a.scale, query0, rows, key0);
    block.run([&](int tid, MmaDq<D>& st) {
      const int warp = tid / kWarpSize, lane = tid % kWarpSize;
      POLLEN_UNROLL
      for (int i = 0; i < D / 32; ++i)
        warp_accumulate<D, false>(lane, warp, i, st.dq[i], sm.dscores, sm.k);
    });
  }
  store_accumulators<D>(
      block, [](MmaDq<D>& st) { return st.dq; }, sm.stage, a.scale, rows, g.s.heads * D,
      a.dq + g.q_at(b, query0, h));
}

// dk, dv grid: x = key tile, y = b * KVH + kv. Visits every query head reading kv head kv and
// the query tiles [key0, query_end) that see the key tile; dk = scale * sum of dS^T q and
// dv = sum of P^T dout stay in the warps' accumulators.
template <int D, typename T, typename Block>
POLLEN_HD void mma_backward_dkdv_block(Block& block, const BackwardArgs<T>& a, int64_t key_tile,
                                       int64_t bkv, void* smem_base) {
  const Geometry& g = a.geo;
  const int64_t seq = g.s.seq, b = bkv / g.s.kv_heads, kv = bkv % g.s.kv_heads;
  const int64_t key0 = key_tile * kTile;
  const int64_t key_rows = tile_rows(seq, key0);
  const int64_t stride = g.s.kv_heads * D;
  const MmaBackwardSmem<D> sm(smem_base);

  block.run([&](int tid, MmaDkDv<D>& st) {
    load_rows_bf16<D>(tid, a.k + g.kv_at(b, key0, kv), stride, key_rows, sm.k);
    load_rows_bf16<D>(tid, a.v + g.kv_at(b, key0, kv), stride, key_rows, sm.v);
    POLLEN_UNROLL
    for (int i = 0; i < D / 32; ++i) {
      mma_zero(tid % kWarpSize, st.dk[i]);
      mma_zero(tid % kWarpSize, st.dv[i]);
    }
  });
  const int64_t query_end = query_end_for_keys(a.seg_start + b * seq, seq, key0, key_rows);
  for (int64_t member = 0; member < g.group(); ++member) {
    const int64_t h = kv * g.group() + member;
    for (int64_t query0 = key0; query0 < query_end; query0 += kTile) {
      const int64_t rows = tile_rows(query_end, query0);
      block.run(
          [&](int tid, MmaDkDv<D>&) { load_query_side_bf16<D>(tid, a, b, h, query0, rows, sm); });
      backward_tile_phases<D>(block, sm, a.scale, query0, rows, key0);
      // dv += P^T dout; dk += dS^T q
      block.run([&](int tid, MmaDkDv<D>& st) {
        const int warp = tid / kWarpSize, lane = tid % kWarpSize;
        POLLEN_UNROLL
        for (int i = 0; i < D / 32; ++i) {
          warp_accumulate<D, true>(lane, warp, i, st.dv[i], sm.probs, sm.dout);
          warp_accumulate<D, true>(lane, warp, i, st.dk[i], sm.dscores, sm.q);
        }
      });
    }
  }
  store_accumulators<D>(
      block, [](MmaDkDv<D>& st) { return st.dk; }, sm.stage, a.scale, key_rows, stride,
      a.dk + g.kv_at(b, key0, kv));
  store_accumulators<D>(
      block, [](MmaDkDv<D>& st) { return st.dv; }, sm.stage, 1.0f, key_rows, stride,
      a.dv + g.kv_at(b, key0, kv));
}

}  // namespace pollen::ops::cuda
