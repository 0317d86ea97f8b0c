// The CUDA attention kernels' block functions (ops/cuda/attention_tiles.h for f32 on CUDA cores,
// ops/cuda/attention_mma.h for bf16 on the tensor cores) run on the CPU: each block of the grid in
// turn, each phase for all 256 threads in turn, with the same tile sizes, loop bounds,
// shared-memory layout and arithmetic as on the GPU, against ops::attention_forward and
// attention_backward in double precision. The tensor-core products run as warp_mma.h emulates
// them: lane 0 of each warp computes the warp's tile, checking WMMA's alignment rules.
//
// What this proves: the tile indexing, the GQA head mapping, the segment masks and the key-tile
// skipping, the online softmax and the backward's math, and that no phase reads shared memory
// another thread writes in the same phase (threads run in both orders with bitwise equal
// results; shared memory and registers start as NaN, so a read of anything unwritten shows).
// What it does not: that the GPU compiles and launches it as written (shared-memory limits,
// registers, barriers that every thread reaches), bf16 conversion on the device, or speed; the
// GPU test (tests/cuda/attention_test.cpp) covers those where a GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/rng.h"
#include "ops/attention.h"
#include "ops/cuda/attention_mma.h"
#include "ops/cuda/attention_tiles.h"
#include "support/attention_inputs.h"

namespace pollen::ops {
namespace {

using testing::random_seg_start;
using testing::relative_error;

namespace cu = pollen::ops::cuda;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A thread block on the CPU: each phase runs for every thread, forwards or backwards, before the
// next (the barrier). Registers start as NaN, as unwritten ones would read on the GPU at worst.
template <typename State>
struct SequentialBlock {
  explicit SequentialBlock(bool reverse) : reverse(reverse), states(cu::kAttentionThreads) {
    static_assert(sizeof(State) % sizeof(float) == 0);
    for (State& s : states)
      std::fill_n(reinterpret_cast<float*>(&s), sizeof(State) / sizeof(float), kNaN);
  }
  template <typename Phase>
  void run(Phase&& phase) {
    for (int n = 0; n < cu::kAttentionThreads; ++n) {
      const int tid = reverse ? cu::kAttentionThreads - 1 - n : n;
      phase(tid, states[static_cast<size_t>(tid)]);
    }
  }
  bool reverse;
  std::vector<State> states;
};

// Shared memory of one block, NaN at the start like memory nothing wrote; 128-byte aligned, as
// the GPU's dynamic shared memory starts.
struct SharedMemory {
  explicit SharedMemory(size_t floats) : data(floats + 32) {}
  float* fresh() {
    std::fill(data.begin(), data.end(), kNaN);
    const auto address = reinterpret_cast<uintptr_t>(data.data());
    return data.data() + (128 - address % 128) % 128 / sizeof(float);
  }
  std::vector<float> data;
};

struct Problem {
  cu::AttentionShape shape;
  std::vector<float> q, k, v, dout;  // f32, as the GPU would read them
  std::vector<int32_t> seg_start;
  float scale;
};

std::vector<float> random_floats(int64_t n, Rng& rng) {
  std::vector<float> x(static_cast<size_t>(n));
  for (float& value : x) value = static_cast<float>(rng.normal());
  return x;
}

Problem random_problem(const cu::AttentionShape& s, int64_t max_run, uint64_t seed) {
  Rng rng(seed);
  const int64_t q_size = s.batch * s.seq * s.heads * s.head_dim;
  const int64_t kv_size = s.batch * s.seq * s.kv_heads * s.head_dim;
  Problem p{s,
            random_floats(q_size, rng),
            random_floats(kv_size, rng),
            random_floats(kv_size, rng),
            random_floats(q_size, rng),
            random_seg_start(s.batch, s.seq, max_run, rng),
            static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)))};
  return p;
}

Tensor as_f64(const std::vector<float>& x, const Shape& shape) {
  return Tensor::from(shape, std::vector<double>(x.begin(), x.end()));
}

struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

// Which kernels: attention_tiles.h's (f32 on CUDA cores) or attention_mma.h's (bf16 on the tensor
// cores).
enum class Kernels { tiles, mma };

// The GPU's forward, then backward (on the forward's own out and lse), as the grids would run.
template <int D, Kernels kKernels = Kernels::tiles>
Results emulate(const Problem& p, bool reverse) {
  const cu::AttentionShape& s = p.shape;
  const cu::Geometry geo{s};
  const int64_t q_size = s.batch * s.seq * s.heads * D;
  const int64_t kv_size = s.batch * s.seq * s.kv_heads * D;
  const int64_t tiles = cu::tile_count(s.seq);
  Results r{std::vector<float>(q_size, kNaN), std::vector<float>(s.batch * s.heads * s.seq, kNaN),
            std::vector<float>(q_size, kNaN), std::vector<float>(kv_size, kNaN),
            std::vector<float>(kv_size, kNaN)};

  const cu::ForwardArgs<float> fwd{geo,          p.q.data(),         p.k.data(),
                                   p.v.data(),   p.seg_start.data(), p.scale,
                                   r.out.data(), r.lse.data()};
  constexpr bool kMma = kKernels == Kernels::mma;
  SharedMemory forward_smem(kMma ? cu::MmaForwardSmem<D>::kBytes / sizeof(float)
                                 : cu::ForwardSmem<D>::kFloats);
  for (int64_t bh = 0; bh < s.batch * s.heads; ++bh) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      if constexpr (kMma) {
        SequentialBlock<cu::MmaNoState> block(reverse);
        cu::mma_forward_block<D>(block, fwd, tile, bh, forward_smem.fresh());
      } else {
        SequentialBlock<cu::Accumulator<D>> block(reverse);
        cu::forward_block<D>(block, fwd, tile, bh, forward_smem.fresh());
      }
    }
  }

  std::vector<float> delta(static_cast<size_t>(s.batch * s.heads * s.seq), kNaN);
  const cu::BackwardArgs<float> bwd{geo,          p.q.data(),    p.k.data(),         p.v.data(),
                                    r.out.data(), p.dout.data(), p.seg_start.data(), r.lse.data(),
                                    delta.data(), p.scale,       r.dq.data(),        r.dk.data(),
                                    r.dv.data()};
  for (int64_t row = 0; row < s.batch * s.seq * s.heads; ++row)
    cu::delta_for_row(bwd, row, delta.data());
  SharedMemory backward_smem(kMma ? cu::MmaBackwardSmem<D>::kBytes / sizeof(float)
                                  : cu::BackwardSmem<D>::kFloats);
  for (int64_t bkv = 0; bkv < s.batch * s.kv_heads; ++bkv) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      if constexpr (kMma) {
        SequentialBlock<cu::MmaDkDv<D>> block(reverse);
        cu::mma_backward_dkdv_block<D>(block, bwd, tile, bkv, backward_smem.fresh());
      } else {
        SequentialBlock<cu::DkDv<D>> block(reverse);
        cu::backward_dkdv_block<D>(block, bwd, tile, bkv, backward_smem.fresh());
      }
    }
  }
  for (int64_t bh = 0; bh < s.batch * s.heads; ++bh) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      if constexpr (kMma) {
        SequentialBlock<cu::MmaDq<D>> block(reverse);
        cu::mma_backward_dq_block<D>(block, bwd, tile, bh, backward_smem.fresh());
      } else {
        SequentialBlock<cu::Accumulator<D>> block(reverse);
        cu::backward_dq_block<D>(block, bwd, tile, bh, backward_smem.fresh());
      }
    }
  }
  return r;
}

// The values as bf16 holds them (the tensor-core kernels' inputs are bf16).
void round_to_bf16(std::vector<float>& x) {
  for (float& value : x) value = bf16::from_float(value).to_float();
}

// f32 kernels agree with the double-precision op to float rounding; the bf16 ones, which round P
// and dS to bf16 for their products (inputs already bf16), to bf16's.
template <int D, Kernels kKernels = Kernels::tiles>
void expect_matches_cpu_op(int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                           int64_t max_run, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "B=" << batch << " T=" << seq << " H=" << heads
                                    << " KVH=" << kv_heads << " D=" << D << " max_run=" << max_run
                                    << (kKernels == Kernels::mma ? " tensor cores" : ""));
  Problem p = random_problem({batch, seq, heads, kv_heads, D}, max_run, seed);
  const double tolerance = kKernels == Kernels::mma ? 5e-3 : 1e-5;
  if (kKernels == Kernels::mma) {
    for (std::vector<float>* x : {&p.q, &p.k, &p.v, &p.dout}) round_to_bf16(*x);
  }
  const Shape qs{batch, seq, heads, D}, kvs{batch, seq, kv_heads, D};
  const Tensor q = as_f64(p.q, qs), k = as_f64(p.k, kvs), v = as_f64(p.v, kvs);
  const Tensor seg = Tensor::from({batch, seq}, p.seg_start);
  Tensor out = Tensor::empty(qs, DType::f64), lse = Tensor::empty({batch, heads, seq}, DType::f64);
  attention_forward(q, k, v, seg, p.scale, out, lse);
  Tensor dq = Tensor::empty(qs, DType::f64), dk = Tensor::empty(kvs, DType::f64),
         dv = Tensor::empty(kvs, DType::f64);
  attention_backward(q, k, v, seg, out, lse, as_f64(p.dout, qs), p.scale, dq, dk, dv);

  const Results got = emulate<D, kKernels>(p, false);
  EXPECT_LT(relative_error(got.out, out), tolerance);
  EXPECT_LT(relative_error(got.lse, lse), tolerance);
  EXPECT_LT(relative_error(got.dq, dq), tolerance);
  EXPECT_LT(relative_error(got.dk, dk), tolerance);
  EXPECT_LT(relative_error(got.dv, dv), tolerance);

  // Threads in the other order: a phase reading what another thread writes in it would differ.
  const Results reversed = emulate<D, kKernels>(p, true);
  EXPECT_EQ(reversed.out, got.out);
  EXPECT_EQ(reversed.lse, got.lse);
  EXPECT_EQ(reversed.dq, got.dq);
  EXPECT_EQ(reversed.dk, got.dk);
  EXPECT_EQ(reversed.dv, got.dv);
}

TEST(CudaAttentionTiles, GroupedQueryFourToOneMatchesTheCpuOp) {
  expect_matches_cpu_op<64>(2, 150, 8, 2, 90, 1);
}

TEST(CudaAttentionTiles, OneKvHeadPerQueryHeadMatchesTheCpuOp) {
  expect_matches_cpu_op<128>(1, 200, 2, 2, 150, 2);
}

TEST(CudaAttentionTiles, HeadDim32AndShortDocumentsMatchTheCpuOp) {
  expect_matches_cpu_op<32>(2, 130, 4, 2, 12, 3);
}

TEST(CudaAttentionTiles, OneDocumentPerRowAndShortSequencesMatchTheCpuOp) {
  expect_matches_cpu_op<64>(1, 200, 2, 1, 1000, 4);
  expect_matches_cpu_op<64>(3, 17, 4, 4, 5, 5);
}

TEST(CudaAttentionMma, GroupedQueryFourToOneMatchesTheCpuOp) {
  expect_matches_cpu_op<64, Kernels::mma>(2, 150, 8, 2, 90, 1);
}

TEST(CudaAttentionMma, OneKvHeadPerQueryHeadMatchesTheCpuOp) {
  expect_matches_cpu_op<128, Kernels::mma>(1, 200, 2, 2, 150, 2);
}

TEST(CudaAttentionMma, HeadDim32AndShortDocumentsMatchTheCpuOp) {
  expect_matches_cpu_op<32, Kernels::mma>(2, 130, 4, 2, 12, 3);
}

TEST(CudaAttentionMma, OneDocumentPerRowAndShortSequencesMatchTheCpuOp) {
  expect_matches_cpu_op<64, Kernels::mma>(1, 200, 2, 1, 1000, 4);
  expect_matches_cpu_op<64, Kernels::mma>(3, 17, 4, 4, 5, 5);
}

// The key tiles a query tile visits are exactly those holding a key one of its queries sees, and
// the queries a key tile's backward visits are exactly those that see one of its keys.
TEST(CudaAttentionTiles, TileScheduleVisitsExactlyTheTilesWithVisibleKeys) {
  Rng rng(6);
  for (const int64_t max_run : {1, 7, 64, 100, 300}) {
    const int64_t seq = 333;
    const std::vector<int32_t> seg = random_seg_start(1, seq, max_run, rng);
    for (int64_t query0 = 0; query0 < seq; query0 += cu::kTile) {
      const int64_t rows = std::min<int64_t>(cu::kTile, seq - query0);
      const cu::TileRange range = cu::key_tiles_for_queries(seg[query0], query0, rows);
      for (int64_t key_tile = 0; key_tile < cu::tile_count(seq); ++key_tile) {
        bool any = false;
        for (int64_t i = query0; i < query0 + rows; ++i)
          for (int64_t j = key_tile * cu::kTile; j < std::min(seq, (key_tile + 1) * cu::kTile); ++j)
            any = any || cu::key_visible(seg[i], i, j);
        EXPECT_EQ(any, key_tile >= range.first && key_tile < range.end)
            << "max_run " << max_run << " query0 " << query0 << " key tile " << key_tile;
      }
    }
    for (int64_t key0 = 0; key0 < seq; key0 += cu::kTile) {
      const int64_t rows = std::min<int64_t>(cu::kTile, seq - key0);
      const int64_t end = cu::query_end_for_keys(seg.data(), seq, key0, rows);
      for (int64_t i = 0; i < seq; ++i) {
        bool any = false;
        for (int64_t j = key0; j < key0 + rows; ++j) any = any || cu::key_visible(seg[i], i, j);
        EXPECT_EQ(any, i >= key0 && i < end)
            << "max_run " << max_run << " key0 " << key0 << " query " << i;
      }
    }
  }
}

TEST(CudaAttentionTiles, OnlineSoftmaxStepsStayFiniteOnMaskedRows) {
  EXPECT_EQ(cu::softmax_rescale(-INFINITY, -INFINITY), 1.0f);
  EXPECT_EQ(cu::softmax_rescale(-INFINITY, 2.0f), 0.0f);
  EXPECT_FLOAT_EQ(cu::softmax_rescale(1.0f, 3.0f), std::exp(-2.0f));
  EXPECT_EQ(cu::shifted_exp(-INFINITY, -INFINITY), 0.0f);
  EXPECT_FLOAT_EQ(cu::shifted_exp(1.0f, 3.0f), std::exp(-2.0f));
  EXPECT_FLOAT_EQ(cu::row_lse(2.0f, 3.0f), 2.0f + std::log(3.0f));
  EXPECT_FLOAT_EQ(cu::score_gradient(0.5f, 2.0f, 0.5f), 0.75f);
}

}  // namespace
}  // namespace pollen::ops
