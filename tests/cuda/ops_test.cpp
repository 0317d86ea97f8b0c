// Every op on the GPU against the same op on the CPU in f64 on the upcast inputs: fresh random
// inputs each run (the seed named in every failure), outputs poisoned with NaN first and guarded
// on both sides against writes past their ends, norm-relative error per tensor under 1e-2 for
// bf16 and 1e-4 for f32, and no element off by more than 10 times that in rms of the reference
// (gpu_compare.h). Accumulating outputs start from the same random values on both sides.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "autograd/tape.h"
#include "autograd/token_logprobs.h"
#include "cuda/gpu_compare.h"
#include "ops/adamw.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/profile.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/token_logprobs.h"

namespace pollen {
namespace {

using testing::guarded_copy;
using testing::Input;
using testing::int_input;
using testing::poisoned;
using testing::random_input;
using testing::rel_err;
using testing::tolerance;

constexpr DType kDtypes[] = {DType::f32, DType::bf16};

std::vector<int32_t> random_ids(Rng& rng, int64_t n, int64_t below) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(below)));
  return ids;
}

TEST(CudaOps, GemmEveryTransposeWithAlphaAndBeta) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t m = 37, n = 53, k = 71;
  for (DType t : kDtypes) {
    for (DType ct : {t, DType::f32}) {
      for (int trans = 0; trans < 4; ++trans) {
        const bool ta = trans & 1, tb = trans & 2;
        SCOPED_TRACE(cat(dtype_name(t), " -> ", dtype_name(ct), " trans_a=", ta, " trans_b=", tb));
        const Input a = random_input(ta ? Shape{k, m} : Shape{m, k}, t, rng);
        const Input b = random_input(tb ? Shape{n, k} : Shape{k, n}, t, rng);
        // beta = 0 must not read c (poisoned); beta != 0 accumulates into random values.
        auto c0 = poisoned({m, n}, ct);
        Tensor ref0 = Tensor::empty({m, n}, DType::f64);
        ops::gemm(a.gpu, ta, b.gpu, tb, c0, 0.7, 0.0);
        ops::gemm(a.ref, ta, b.ref, tb, ref0, 0.7, 0.0);
        EXPECT_CLOSE(c0, ref0, t);
        const Input c = random_input({m, n}, ct, rng);
        auto c1 = guarded_copy(c.gpu);
        Tensor ref1 = c.ref.clone();
        ops::gemm(a.gpu, ta, b.gpu, tb, c1, -1.3, 0.4);
        ops::gemm(a.ref, ta, b.ref, tb, ref1, -1.3, 0.4);
        EXPECT_CLOSE(c1, ref1, t);
      }
    }
  }
}

TEST(CudaOps, GemmWithAUnitDimension) {
  POLLEN_REQUIRE_GPU();
  // The shapes of a bias: broadcast over rows, ones (N,1) @ bias (1,M) (k = 1), and its
  // gradient, ones (1,N) @ dy (N,M) (m = 1); and a matrix-vector product (n = 1).
  POLLEN_FRESH_RNG(rng);
  struct Case {
    int64_t m, n, k;
  };
  for (const Case& s : {Case{300, 96, 1}, Case{1, 96, 300}, Case{96, 1, 300}}) {
    for (DType t : kDtypes) {
      SCOPED_TRACE(cat(dtype_name(t), " m=", s.m, " n=", s.n, " k=", s.k));
      const Input a = random_input({s.m, s.k}, t, rng), b = random_input({s.k, s.n}, t, rng);
      auto c = poisoned({s.m, s.n}, t);
      Tensor ref = Tensor::empty({s.m, s.n}, DType::f64);
      ops::gemm(a.gpu, false, b.gpu, false, c, 1.0, 0.0);
      ops::gemm(a.ref, false, b.ref, false, ref, 1.0, 0.0);
      EXPECT_CLOSE(c, ref, t);
    }
  }
}

TEST(CudaOps, GemmWithAnEmptyInnerDimensionScalesC) {
  POLLEN_REQUIRE_GPU();
  // k = 0: op(a) op(b) is an empty sum, so c = beta * c, and zero when beta = 0 (c not read).
  POLLEN_FRESH_RNG(rng);
  const int64_t m = 37, n = 53;
  for (DType t : kDtypes) {
    for (DType ct : {t, DType::f32}) {
      for (int trans = 0; trans < 4; ++trans) {
        const bool ta = trans & 1, tb = trans & 2;
        SCOPED_TRACE(cat(dtype_name(t), " -> ", dtype_name(ct), " trans_a=", ta, " trans_b=", tb));
        const Input a = random_input(ta ? Shape{0, m} : Shape{m, 0}, t, rng);
        const Input b = random_input(tb ? Shape{n, 0} : Shape{0, n}, t, rng);
        auto c0 = poisoned({m, n}, ct);
        ops::gemm(a.gpu, ta, b.gpu, tb, c0, 0.7, 0.0);
        EXPECT_EQ(c0.to_doubles(), std::vector<double>(static_cast<size_t>(m * n), 0.0));
        EXPECT_TRUE(c0.guards_intact());
        const Input c = random_input({m, n}, ct, rng);
        auto c1 = guarded_copy(c.gpu);
        Tensor ref1 = Tensor::empty({m, n}, DType::f64);
        ops::gemm(a.gpu, ta, b.gpu, tb, c1, -1.3, 0.4);
        ops::scale_into(0.4, c.ref, ref1);
        EXPECT_CLOSE(c1, ref1, ct);
      }
    }
  }
}

TEST(CudaOps, GemmPlansFollowThePointersAlignment) {
  POLLEN_REQUIRE_GPU();
  // gemm keeps cuBLASLt's plan per shape and alignment: the same shape one element past an
  // aligned address needs a kernel that assumes less, so a plan made for the aligned call and
  // reused for it would be refused or misread. Aligned, offset, then aligned again.
  POLLEN_FRESH_RNG(rng);
  const int64_t m = 64, n = 96, k = 128;
  for (DType t : kDtypes) {
    const Input a = random_input({m * k + 1}, t, rng), b = random_input({k * n + 1}, t, rng);
    for (int64_t offset : {0, 1, 0}) {
      SCOPED_TRACE(cat(dtype_name(t), " offset=", offset));
      const auto part = [&](const Tensor& x, int64_t rows, int64_t cols) {
        return x.slice(0, offset, offset + rows * cols).view({rows, cols});
      };
      Tensor c = part(poisoned({m * n + 1}, t), m, n), ref = Tensor::empty({m, n}, DType::f64);
      ops::gemm(part(a.gpu, m, k), false, part(b.gpu, k, n), false, c, 1.0, 0.0);
      ops::gemm(part(a.ref, m, k), false, part(b.ref, k, n), false, ref, 1.0, 0.0);
      EXPECT_CLOSE(c, ref, t);
    }
  }
}

TEST(CudaOps, GemmFp32IsNotTf32) {
  POLLEN_REQUIRE_GPU();
  // TF32 keeps 10 mantissa bits: its products are off by ~3e-4 (norm-relative) here, where fp32's
  // rounding and summation order give ~3e-7; 1e-5 is 30 times from both.
  POLLEN_FRESH_RNG(rng);
  const Input a = random_input({64, 256}, DType::f32, rng),
              b = random_input({256, 64}, DType::f32, rng);
  auto c = poisoned({64, 64}, DType::f32);
  Tensor ref = Tensor::empty({64, 64}, DType::f64);
  ops::gemm(a.gpu, false, b.gpu, false, c, 1.0, 0.0);
  ops::gemm(a.ref, false, b.ref, false, ref, 1.0, 0.0);
  EXPECT_LT(rel_err(c, ref), 1e-5);
}

TEST(CudaOps, OpProfileTimesGpuOpsBetweenEvents) {
  POLLEN_REQUIRE_GPU();
  // Ops on the GPU are timed by events around their work: each GEMM of 512^3 takes GPU time,
  // and the profile's sum lies within the wall time of the whole (read after the GPU is done).
  POLLEN_FRESH_RNG(rng);
  const Input a = random_input({512, 512}, DType::f32, rng),
              b = random_input({512, 512}, DType::f32, rng);
  Tensor c = poisoned({512, 512}, DType::f32);
  const auto t0 = std::chrono::steady_clock::now();
  ops::OpProfile profile;
  for (int i = 0; i < 3; ++i) ops::gemm(a.gpu, false, b.gpu, false, c, 1.0, 0.0);
  ops::add(a.gpu, b.gpu, c);
  const auto entries = profile.entries();
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].op, "gemm");
  EXPECT_EQ(entries[0].calls, 3);
  EXPECT_GT(entries[0].ms, 0);
  EXPECT_EQ(entries[1].op, "add");
  EXPECT_EQ(entries[1].calls, 1);
  EXPECT_LE(entries[0].ms + entries[1].ms, wall_ms);
}

TEST(CudaOps, Elementwise) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const Shape s = {3, 1001};
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const Input a = random_input(s, t, rng), b = random_input(s, t, rng);
    auto out = poisoned(s, t);
    Tensor ref = Tensor::empty(s, DType::f64);
    ops::add(a.gpu, b.gpu, out);
    ops::add(a.ref, b.ref, ref);
    EXPECT_CLOSE(out, ref, t);
    out = poisoned(s, t);
    ops::mul(a.gpu, b.gpu, out);
    ops::mul(a.ref, b.ref, ref);
    EXPECT_CLOSE(out, ref, t);
    out = poisoned(s, t);
    ops::scale_into(-0.37, a.gpu, out);
    ops::scale_into(-0.37, a.ref, ref);
    EXPECT_CLOSE(out, ref, t);
    const Input y = random_input(s, t, rng);
    auto y_gpu = guarded_copy(y.gpu);
    Tensor y_ref = y.ref.clone();
    ops::axpy(0.61, a.gpu, y_gpu);
    ops::axpy(0.61, a.ref, y_ref);
    EXPECT_CLOSE(y_gpu, y_ref, t);
  }
}

// More elements than one pass of the elementwise grids (grid_blocks: at most 65535 blocks of 256
// threads, 16.8 M elements): the grid-stride loops go round twice and must reach the tail, which
// stays NaN otherwise.
TEST(CudaOps, AddAndConvertBeyondOneGridPass) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t n = int64_t{65535} * 256 + 223'043;  // ~17 M
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const Input a = random_input({n}, t, rng), b = random_input({n}, t, rng);
    auto out = poisoned({n}, t);
    Tensor ref = Tensor::empty({n}, DType::f64);
    ops::add(a.gpu, b.gpu, out);
    ops::add(a.ref, b.ref, ref);
    EXPECT_CLOSE(out, ref, t);
  }
  // f32 -> bf16 on the GPU (copy_'s conversion kernel) rounds to nearest even as the host does,
  // and bf16 -> f32 is exact: both equal their reference.
  const Input x = random_input({n}, DType::f32, rng);
  auto narrowed = poisoned({n}, DType::bf16);
  narrowed.copy_(x.gpu);
  EXPECT_EQ(rel_err(narrowed, x.gpu.to(Device::cpu).to(DType::bf16)), 0.0);
  EXPECT_TRUE(narrowed.guards_intact());
  const Input y = random_input({n}, DType::bf16, rng);
  auto widened = poisoned({n}, DType::f32);
  widened.copy_(y.gpu);
  EXPECT_EQ(rel_err(widened, y.ref), 0.0);
  EXPECT_TRUE(widened.guards_intact());
}

TEST(CudaOps, SwiGLUForwardAndBackward) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const Shape s = {5, 777};
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const Input gate = random_input(s, t, rng, 2.0), up = random_input(s, t, rng),
                dout = random_input(s, t, rng);
    auto out = poisoned(s, t);
    Tensor ref = Tensor::empty(s, DType::f64);
    ops::swiglu_forward(gate.gpu, up.gpu, out);
    ops::swiglu_forward(gate.ref, up.ref, ref);
    EXPECT_CLOSE(out, ref, t);
    auto dgate = poisoned(s, t), dup = poisoned(s, t);
    Tensor dgate_ref = Tensor::empty(s, DType::f64), dup_ref = Tensor::empty(s, DType::f64);
    ops::swiglu_backward(dout.gpu, gate.gpu, up.gpu, dgate, dup);
    ops::swiglu_backward(dout.ref, gate.ref, up.ref, dgate_ref, dup_ref);
    EXPECT_CLOSE(dgate, dgate_ref, t);
    EXPECT_CLOSE(dup, dup_ref, t);
  }
}

TEST(CudaOps, EmbeddingForwardAndBackward) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t v = 97, c = 300, n = 500;  // ids repeat: the backward sums several tokens per row
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const Input table = random_input({v, c}, t, rng);
    const Input ids = int_input({n}, random_ids(rng, n, v));
    auto out = poisoned({n, c}, t);
    Tensor ref = Tensor::empty({n, c}, DType::f64);
    ops::embedding_forward(table.gpu, ids.gpu, out);
    ops::embedding_forward(table.ref, ids.ref, ref);
    EXPECT_EQ(rel_err(out, ref), 0.0);  // a copy
    EXPECT_TRUE(out.guards_intact());
    const Input dout = random_input({n, c}, t, rng);
    const Input dtable = random_input({v, c}, t, rng);
    auto dtable_gpu = guarded_copy(dtable.gpu);
    Tensor dtable_ref = dtable.ref.clone();
    ops::embedding_backward(dout.gpu, ids.gpu, dtable_gpu);
    ops::embedding_backward(dout.ref, ids.ref, dtable_ref);
    EXPECT_CLOSE(dtable_gpu, dtable_ref, t);
    // Grouped ahead (as the autograd's forward does): the same sums, bit for bit.
    const ops::EmbeddingRows rows = ops::embedding_rows(ids.gpu, v);
    Tensor dtable_grouped = dtable.gpu.clone(), dtable_here = dtable.gpu.clone();
    ops::embedding_backward(dout.gpu, ids.gpu, dtable_grouped, &rows);
    ops::embedding_backward(dout.gpu, ids.gpu, dtable_here);
    EXPECT_EQ(rel_err(dtable_grouped, dtable_here), 0.0);
    EXPECT_LT(rows.rows.numel(), n);  // repeated ids share a row
    const Input bad = int_input({2}, {0, static_cast<int32_t>(v)});
    Tensor out2 = poisoned({2, c}, t);
    EXPECT_THROW(ops::embedding_forward(table.gpu, bad.gpu, out2), Error);
    EXPECT_THROW(ops::embedding_rows(bad.gpu, v), Error);
  }
}

TEST(CudaOps, RMSNormForwardAndBackward) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  // dw sums over chunks of rows: 67 rows make 2 chunks, 3001 rows 47 (the last one short), and
  // 200 channels leave the second block of channels part empty. 8193 rows reach the cap of 128
  // chunks, of 65 rows: chunk 126 holds the last 3 rows and chunk 127 none (it starts at row
  // 8255), so its partial sums must come out zero.
  struct Case {
    int64_t n, c;
  };
  for (const auto [n, c] : {Case{67, 384}, Case{3001, 200}, Case{8193, 64}}) {
    for (DType t : kDtypes) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(cat(dtype_name(t), " n=", n, " c=", c, accumulate ? " accumulating dx" : ""));
        const Input x = random_input({n, c}, t, rng, 2.0), w = random_input({c}, t, rng),
                    dy = random_input({n, c}, t, rng);
        auto y = poisoned({n, c}, t), rstd = poisoned({n}, DType::f32);
        Tensor y_ref = Tensor::empty({n, c}, DType::f64), rstd_ref = Tensor::empty({n}, DType::f64);
        ops::rmsnorm_forward(x.gpu, w.gpu, 1e-5, y, rstd);
        ops::rmsnorm_forward(x.ref, w.ref, 1e-5, y_ref, rstd_ref);
        EXPECT_CLOSE(y, y_ref, t);
        EXPECT_CLOSE(rstd, rstd_ref, DType::f32);  // f32 statistics whatever x's dtype
        const Input dx0 = random_input({n, c}, t, rng), dw0 = random_input({c}, t, rng);
        auto dx = accumulate ? guarded_copy(dx0.gpu) : poisoned({n, c}, t);
        auto dw = guarded_copy(dw0.gpu);
        Tensor dx_ref = dx0.ref.clone(), dw_ref = dw0.ref.clone();
        ops::rmsnorm_backward(dy.gpu, x.gpu, w.gpu, rstd, dx, dw, accumulate);
        ops::rmsnorm_backward(dy.ref, x.ref, w.ref, rstd_ref, dx_ref, dw_ref, accumulate);
        EXPECT_CLOSE(dx, dx_ref, t);
        EXPECT_CLOSE(dw, dw_ref, t);
      }
    }
  }
}

TEST(CudaOps, RopeForwardAndBackwardWithScalingAndRestarts) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t b = 2, seq = 40, h = 3, d = 64;
  std::vector<int32_t> pos(static_cast<size_t>(b * seq));
  for (int64_t i = 0; i < b * seq; ++i)  // documents restart at 0 inside row 1
    pos[static_cast<size_t>(i)] = static_cast<int32_t>(i < seq ? 3000 + i : (i - seq) % 17);
  const Input positions = int_input({b, seq}, pos);
  ops::RopeScaling llama3;
  llama3.kind = ops::RopeScaling::Kind::llama3;
  llama3.factor = 8.0;
  llama3.original_max_position_embeddings = 2048;
  for (const ops::RopeParams& params :
       {ops::RopeParams(10000.0), ops::RopeParams(500000.0, llama3)}) {
    for (DType t : kDtypes) {
      SCOPED_TRACE(cat(dtype_name(t), " theta=", params.theta));
      const Input x = random_input({b, seq, h, d}, t, rng);
      auto out = poisoned({b, seq, h, d}, t);
      Tensor ref = Tensor::empty({b, seq, h, d}, DType::f64);
      ops::rope_forward(x.gpu, positions.gpu, params, out);
      ops::rope_forward(x.ref, positions.ref, params, ref);
      EXPECT_CLOSE(out, ref, t);
      auto dx = poisoned({b, seq, h, d}, t);
      Tensor dx_ref = Tensor::empty({b, seq, h, d}, DType::f64);
      ops::rope_backward(x.gpu, positions.gpu, params, dx);
      ops::rope_backward(x.ref, positions.ref, params, dx_ref);
      EXPECT_CLOSE(dx, dx_ref, t);
      auto in_place = guarded_copy(x.gpu);  // out may be x
      ops::rope_forward(in_place, positions.gpu, params, in_place);
      EXPECT_CLOSE(in_place, ref, t);
    }
  }
}

TEST(CudaOps, CrossEntropyOverVocabularyBlocks) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t n = 70, c = 48, v = 1031, block_rows = 16;  // five blocks, the last partial;
  // V spans several passes of a row's 512 threads.
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<int32_t> targets = random_ids(rng, n, v);
    targets[3] = ops::kIgnoreIndex;
    targets[40] = ops::kIgnoreIndex;
    const Input tg = int_input({n}, targets);
    const Input h = random_input({n, c}, t, rng), w = random_input({v, c}, t, rng, 0.3);
    const Input dw0 = random_input({v, c}, t, rng, 0.1);
    // The grads share the guarded outputs' storage: dh and dw are checked through them.
    auto dh = poisoned({n, c}, t), dw = guarded_copy(dw0.gpu);
    ops::CrossEntropyGrads grads{dh, dw, 0.05};
    ops::CrossEntropyGrads grads_ref{Tensor::empty({n, c}, DType::f64), dw0.ref.clone(), 0.05};
    int64_t scored = 0, scored_ref = 0;
    const double loss =
        ops::cross_entropy_forward(h.gpu, w.gpu, tg.gpu, &scored, &grads, block_rows);
    const double loss_ref =
        ops::cross_entropy_forward(h.ref, w.ref, tg.ref, &scored_ref, &grads_ref, block_rows);
    EXPECT_EQ(scored, n - 2);
    EXPECT_EQ(scored, scored_ref);
    EXPECT_LT(std::abs(loss - loss_ref) / std::abs(loss_ref), tolerance(t))
        << loss << " vs " << loss_ref;
    EXPECT_CLOSE(dh, grads_ref.dh, t);
    EXPECT_CLOSE(dw, grads_ref.dw, t);
    // dw alone (dh undefined: not computed), as on the CPU.
    auto dw_alone = guarded_copy(dw0.gpu);
    ops::CrossEntropyGrads only_dw{Tensor(), dw_alone, 0.05};
    int64_t scored_dw = 0;
    ops::cross_entropy_forward(h.gpu, w.gpu, tg.gpu, &scored_dw, &only_dw, block_rows);
    EXPECT_CLOSE(dw_alone, grads_ref.dw, t);
    // The loss alone, in the default block size.
    int64_t scored_only = 0;
    const double loss_only = ops::cross_entropy_forward(h.gpu, w.gpu, tg.gpu, &scored_only);
    EXPECT_LT(std::abs(loss_only - loss_ref) / std::abs(loss_ref), tolerance(t));
  }
}

TEST(CudaOps, TokenLogprobsForwardAndBackwardOverVocabularyBlocks) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t n = 70, c = 48, v = 1031, block_rows = 16;  // as for cross-entropy
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<int32_t> targets = random_ids(rng, n, v);
    targets[5] = ops::kIgnoreIndex;
    targets[66] = ops::kIgnoreIndex;
    const Input tg = int_input({n}, targets);
    const Input h = random_input({n, c}, t, rng), w = random_input({v, c}, t, rng, 0.3);
    // logp and lse are f32 on the GPU whatever h's dtype.
    auto logp = poisoned({n}, DType::f32), lse = poisoned({n}, DType::f32);
    Tensor logp_ref = Tensor::empty({n}, DType::f64), lse_ref = Tensor::empty({n}, DType::f64);
    // At a sampling temperature other than 1 (GRPO's): the logits divided by it.
    const double temperature = 0.7;
    ops::token_logprobs_forward(h.gpu, w.gpu, tg.gpu, logp, lse, temperature, block_rows);
    ops::token_logprobs_forward(h.ref, w.ref, tg.ref, logp_ref, lse_ref, temperature, block_rows);
    EXPECT_CLOSE(logp, logp_ref, t);
    EXPECT_CLOSE(lse, lse_ref, t);
    EXPECT_EQ(logp.to_doubles()[5], 0.0);  // not scored

    const Input dlogp = random_input({n}, DType::f32, rng);
    const Input dw0 = random_input({v, c}, t, rng, 0.1);
    auto dh = poisoned({n, c}, t), dw = guarded_copy(dw0.gpu);
    Tensor dh_ref = Tensor::empty({n, c}, DType::f64), dw_ref = dw0.ref.clone();
    ops::token_logprobs_backward(dlogp.gpu, h.gpu, w.gpu, tg.gpu, lse, dh, dw, temperature,
                                 block_rows);
    ops::token_logprobs_backward(dlogp.ref, h.ref, w.ref, tg.ref, lse_ref, dh_ref, dw_ref,
                                 temperature, block_rows);
    EXPECT_CLOSE(dh, dh_ref, t);
    EXPECT_CLOSE(dw, dw_ref, t);
  }
}

// The LM head's inputs for dw summed over many blocks of one row (as over the hundreds of blocks
// of a real batch): hidden states that share a direction (offset 1), as real ones do, so that
// every block adds to each vocabulary row's dw a small term of the same sign. A bf16 dw rounded
// after each block loses most of those terms (~8% error here, by a host simulation of the
// roundings; not yet measured on a GPU); summed in fp32 and rounded once it is within ~0.2%.
struct ManyBlocksInputs {
  Input targets, h, w, dw0;
};

ManyBlocksInputs many_blocks_inputs(DType t, Rng& rng, int64_t n, int64_t c, int64_t v) {
  std::vector<int32_t> targets = random_ids(rng, n, v);
  targets[7] = ops::kIgnoreIndex;
  return {int_input({n}, targets), random_input({n, c}, t, rng, 1.0, 1.0),
          random_input({v, c}, t, rng, 0.1), random_input({v, c}, t, rng, 0.1)};
}

TEST(CudaOps, CrossEntropyWeightGradientOverManyBlocks) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t n = 300, c = 48, v = 1031, block_rows = 1;  // 300 blocks
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const ManyBlocksInputs in = many_blocks_inputs(t, rng, n, c, v);
    ops::CrossEntropyGrads grads{poisoned({n, c}, t), in.dw0.gpu, 0.05};
    ops::CrossEntropyGrads grads_ref{Tensor::empty({n, c}, DType::f64), in.dw0.ref.clone(), 0.05};
    int64_t scored = 0, scored_ref = 0;
    ops::cross_entropy_forward(in.h.gpu, in.w.gpu, in.targets.gpu, &scored, &grads, block_rows);
    ops::cross_entropy_forward(in.h.ref, in.w.ref, in.targets.ref, &scored_ref, &grads_ref,
                               block_rows);
    EXPECT_CLOSE(grads.dh, grads_ref.dh, t);
    EXPECT_CLOSE(grads.dw, grads_ref.dw, t);
  }
}

TEST(CudaOps, TokenLogprobsWeightGradientOverManyBlocks) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t n = 300, c = 48, v = 1031, block_rows = 1;  // as for cross-entropy
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const ManyBlocksInputs in = many_blocks_inputs(t, rng, n, c, v);
    Tensor logp = poisoned({n}, DType::f32), lse = poisoned({n}, DType::f32);
    Tensor logp_ref = Tensor::empty({n}, DType::f64), lse_ref = Tensor::empty({n}, DType::f64);
    ops::token_logprobs_forward(in.h.gpu, in.w.gpu, in.targets.gpu, logp, lse, 1.0, block_rows);
    ops::token_logprobs_forward(in.h.ref, in.w.ref, in.targets.ref, logp_ref, lse_ref, 1.0,
                                block_rows);
    // dlogp of one sign (-0.05 +- 0.01, as the cross-entropy's -grad_scale): the same small terms.
    const Input dlogp = random_input({n}, DType::f32, rng, 0.01, -0.05);
    Tensor dh = poisoned({n, c}, t), dw = in.dw0.gpu;
    Tensor dh_ref = Tensor::empty({n, c}, DType::f64), dw_ref = in.dw0.ref.clone();
    ops::token_logprobs_backward(dlogp.gpu, in.h.gpu, in.w.gpu, in.targets.gpu, lse, dh, dw, 1.0,
                                 block_rows);
    ops::token_logprobs_backward(dlogp.ref, in.h.ref, in.w.ref, in.targets.ref, lse_ref, dh_ref,
                                 dw_ref, 1.0, block_rows);
    EXPECT_CLOSE(dh, dh_ref, t);
    EXPECT_CLOSE(dw, dw_ref, t);
  }
}

// Through autograd, as GRPO calls it: targets on the host, h and w on the GPU; the gradients of
// a weighted sum of the log-probabilities against the same on the CPU in f64.
TEST(CudaOps, TokenLogprobsThroughAutogradWithHostTargets) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const int64_t n = 40, c = 32, v = 300;
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<int32_t> ids = random_ids(rng, n, v);
    ids[7] = ops::kIgnoreIndex;
    const Tensor targets = Tensor::from<int32_t>({n}, ids);
    const Input h = random_input({n, c}, t, rng), w = random_input({v, c}, t, rng, 0.3);
    const Input weights = random_input({n}, DType::f32, rng);
    auto run = [&](const Tensor& hv, const Tensor& wv, const Tensor& dy) {
      ag::Var hvar(hv.clone(), true), wvar(wv.clone(), true);
      ag::Tape tape;
      ag::Var logp;
      {
        ag::TapeScope scope(tape);
        logp = ag::token_logprobs(hvar, wvar, targets);
      }
      tape.backward(logp, dy);
      return std::vector<Tensor>{logp.value(), hvar.grad(), wvar.grad()};
    };
    const auto gpu = run(h.gpu, w.gpu, weights.gpu);
    const auto ref = run(h.ref, w.ref, weights.ref);
    EXPECT_EQ(gpu[0].device(), Device::cuda);
    EXPECT_EQ(gpu[0].dtype(), DType::f32);
    EXPECT_CLOSE(gpu[0], ref[0], t);
    EXPECT_CLOSE(gpu[1], ref[1], t);
    EXPECT_CLOSE(gpu[2], ref[2], t);
  }
}

// a - b in f64 on the host.
Tensor minus(const Tensor& a, const Tensor& b) {
  std::vector<double> d = a.to_doubles();
  const std::vector<double> bd = b.to_doubles();
  for (size_t i = 0; i < d.size(); ++i) d[i] -= bd[i];
  return Tensor::from<double>(a.shape(), d);
}

// Three AdamW steps with mixed precision on the GPU (f32 master weights and state, bf16 or f32
// gradients, a bf16 model copy) against the f64 CPU op on the same gradients. 102 tensors: more
// than one launch's list (kMultiTensors), of sizes from 1 to 1000, with and without weight decay.
TEST(CudaOps, AdamWMixedPrecisionOverSteps) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  std::vector<Shape> shapes = {{33, 17}, {1000}};
  for (int64_t i = 0; i < 100; ++i) shapes.push_back({i * 37 % 301 + 1});
  for (DType grad_type : kDtypes) {
    SCOPED_TRACE(cat("grads ", dtype_name(grad_type)));
    std::vector<ops::AdamWSlot> gpu, cpu;
    std::vector<Tensor> starts;  // the parameters before the steps (f64, CPU)
    for (const Shape& s : shapes) {
      const Input p = random_input(s, DType::f32, rng);
      const double decay = gpu.size() % 2 ? 0.0 : 0.1;
      starts.push_back(p.ref);
      gpu.push_back({p.gpu, Tensor(), Tensor::zeros(s, DType::f32, Device::cuda),
                     Tensor::zeros(s, DType::f32, Device::cuda), decay, poisoned(s, DType::bf16)});
      cpu.push_back({p.ref.clone(), Tensor(), Tensor::zeros(s, DType::f64),
                     Tensor::zeros(s, DType::f64), decay});
    }
    for (int step = 1; step <= 3; ++step) {
      for (size_t i = 0; i < gpu.size(); ++i) {
        const Input g = random_input(gpu[i].param.shape(), grad_type, rng);
        gpu[i].grad = g.gpu;
        cpu[i].grad = g.ref;
      }
      ops::AdamWHyper hyper{1e-2, 0.9, 0.95, 1e-8, step, 0.5};
      ops::adamw_step(gpu, hyper);
      ops::adamw_step(cpu, hyper);
    }
    for (size_t i = 0; i < gpu.size(); ++i) {
      EXPECT_CLOSE(gpu[i].param, cpu[i].param, DType::f32);
      // The parameters are dominated by their starting values, which both sides share: the
      // updates themselves must agree too.
      EXPECT_CLOSE(minus(gpu[i].param, starts[i]), minus(cpu[i].param, starts[i]), DType::f32);
      EXPECT_CLOSE(gpu[i].exp_avg, cpu[i].exp_avg, DType::f32);
      EXPECT_CLOSE(gpu[i].exp_avg_sq, cpu[i].exp_avg_sq, DType::f32);
      EXPECT_CLOSE(gpu[i].model_copy, cpu[i].param, DType::bf16);
    }
  }
}

TEST(CudaOps, GlobalNormAndClippingStayOnTheGpu) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const Input a = random_input({300, 7}, DType::f32, rng),
              b = random_input({4097}, DType::bf16, rng);
  double sum_ref = 0;
  for (const Tensor& r : {a.ref, b.ref})
    for (double x : r.to_doubles()) sum_ref += x * x;
  EXPECT_LT(std::abs(ops::sum_of_squares({a.gpu, b.gpu}) - sum_ref) / sum_ref, 1e-6);
  // A list longer than one launch takes (kMultiTensors): 100 tensors, f32 and bf16 in turn.
  std::vector<Tensor> many;
  double many_ref = 0;
  for (int64_t i = 0; i < 100; ++i) {
    const Input x = random_input({i * 53 % 997 + 1}, kDtypes[i % 2], rng);
    many.push_back(x.gpu);
    for (double e : x.ref.to_doubles()) many_ref += e * e;
  }
  EXPECT_LT(std::abs(ops::sum_of_squares(many) - many_ref) / many_ref, 1e-6);
  const double norm_ref = std::sqrt(sum_ref);
  // Clipped: max_norm below the norm.
  const std::vector<double> clipped = ops::clip_factor({a.gpu, b.gpu}, norm_ref / 4).to_doubles();
  EXPECT_LT(std::abs(clipped[0] - norm_ref) / norm_ref, 1e-6);
  EXPECT_LT(std::abs(clipped[1] - (norm_ref / 4) / (norm_ref + 1e-6)), 1e-6);
  // Not clipped: max_norm above the norm, or 0 (off).
  EXPECT_EQ(ops::clip_factor({a.gpu, b.gpu}, norm_ref * 2).to_doubles()[1], 1.0);
  EXPECT_EQ(ops::clip_factor({a.gpu, b.gpu}, 0.0).to_doubles()[1], 1.0);

  // AdamW with the factor read on the GPU equals AdamW with the same factor given by the host.
  const Input p = random_input({300, 7}, DType::f32, rng);
  std::vector<ops::AdamWSlot> on_gpu = {{p.gpu.clone(), a.gpu,
                                         Tensor::zeros({300, 7}, DType::f32, Device::cuda),
                                         Tensor::zeros({300, 7}, DType::f32, Device::cuda), 0.0}};
  std::vector<ops::AdamWSlot> by_host = {{p.gpu.clone(), a.gpu,
                                          Tensor::zeros({300, 7}, DType::f32, Device::cuda),
                                          Tensor::zeros({300, 7}, DType::f32, Device::cuda), 0.0}};
  ops::AdamWHyper device_hyper{1e-2, 0.9, 0.95, 1e-8, 1, 1.0};
  device_hyper.device_clip = ops::clip_factor({a.gpu, b.gpu}, norm_ref / 4);
  ops::adamw_step(on_gpu, device_hyper);
  ops::adamw_step(by_host, {1e-2, 0.9, 0.95, 1e-8, 1, clipped[1]});
  EXPECT_LT(rel_err(on_gpu[0].param, by_host[0].param.to(DType::f64)), 1e-6);

  // A non-finite norm leaves the parameters unchanged.
  Tensor bad = a.gpu.clone();
  bad.slice(0, 5, 6).fill_(std::nan(""));
  ops::AdamWHyper skip{1e-2, 0.9, 0.95, 1e-8, 2, 1.0};
  skip.device_clip = ops::clip_factor({bad}, 1.0);
  const std::vector<double> before = on_gpu[0].param.to_doubles();
  on_gpu[0].grad = bad;
  ops::adamw_step(on_gpu, skip);
  EXPECT_EQ(on_gpu[0].param.to_doubles(), before);
}

TEST(CudaOps, TensorsOnTwoDevicesAreRefused) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const Input a = random_input({4, 5}, DType::f32, rng);
  Tensor out = Tensor::empty({4, 5}, DType::f32);  // on the CPU
  try {
    ops::add(a.gpu, a.gpu, out);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add: out is on cpu, expected cuda"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pollen
