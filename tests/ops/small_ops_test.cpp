// Forward passes on hand-computed cases, and the fused AdamW against PyTorch's update rule.
#include <gtest/gtest.h>

#include <cmath>

#include "base/rng.h"
#include "base/thread_pool.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/rmsnorm.h"

namespace pollen {
namespace {

TEST(RMSNorm, HandComputed) {
  // x = (3, 4): mean square 12.5, rstd 1/sqrt(12.5 + eps).
  Tensor x = Tensor::from<double>({1, 2}, {3, 4}), w = Tensor::from<double>({2}, {1, 2});
  Tensor y = Tensor::empty({1, 2}, DType::f64), rstd = Tensor::empty({1}, DType::f64);
  ops::rmsnorm_forward(x, w, 0.0, y, rstd);
  EXPECT_NEAR(y.to_doubles()[0], 3 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(y.to_doubles()[1], 8 / std::sqrt(12.5), 1e-15);
}

TEST(SwiGLU, HandComputed) {
  Tensor g = Tensor::from<double>({2}, {0, 2}), u = Tensor::from<double>({2}, {5, 3});
  Tensor out = Tensor::empty({2}, DType::f64);
  ops::swiglu_forward(g, u, out);
  EXPECT_EQ(out.to_doubles()[0], 0.0);
  EXPECT_NEAR(out.to_doubles()[1], 2 / (1 + std::exp(-2.0)) * 3, 1e-15);
}

TEST(Embedding, RowsAndBadIds) {
  Tensor table = Tensor::from<float>({3, 2}, {0, 1, 10, 11, 20, 21});
  Tensor out = Tensor::empty({2, 2}, DType::f32);
  ops::embedding_forward(table, Tensor::from<int32_t>({2}, {2, 0}), out);
  EXPECT_EQ(out.to_doubles(), (std::vector<double>{20, 21, 0, 1}));
  EXPECT_THROW(ops::embedding_forward(table, Tensor::from<int32_t>({2}, {3, 0}), out), Error);
}

TEST(AdamW, MatchesPyTorchUpdateRuleOverSteps) {
  // torch.optim.AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  // p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1, scale = 0.5;
  std::vector<double> p = {1.0, -2.0, 0.5}, m(3, 0), v(3, 0);
  const std::vector<std::vector<double>> grads = {{0.1, -0.3, 2.0}, {0.2, 0.1, -1.0}, {0, 5, 1}};
  ops::AdamWSlot s{Tensor::from<double>({3}, p), Tensor(), Tensor::zeros({3}, DType::f64),
                   Tensor::zeros({3}, DType::f64), wd};
  for (int t = 1; t <= 3; ++t) {
    s.grad = Tensor::from<double>({3}, grads[t - 1]);
    std::vector<ops::AdamWSlot> slots = {s};
    ops::adamw_step(slots, {lr, b1, b2, eps, t, scale});
    for (int i = 0; i < 3; ++i) {
      const double g = grads[t - 1][i] * scale;
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      p[i] -= lr / (1 - std::pow(b1, t)) * m[i] /
              (std::sqrt(v[i]) / std::sqrt(1 - std::pow(b2, t)) + eps);
    }
    auto got = s.param.to_doubles();
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(got[i], p[i], 1e-14) << "step " << t;
  }
}

TEST(SumOfSquares, AcrossTensors) {
  std::vector<Tensor> ts = {Tensor::from<float>({2}, {3, 4}), Tensor::from<double>({1}, {12})};
  EXPECT_EQ(ops::sum_of_squares(ts), 169.0);
}

// Many tensors of odd sizes, f32 and f64, empty ones among them, cut across threads' chunks:
// every element counts once, and the total is the same on every call.
TEST(SumOfSquares, ManyTensorsAcrossChunks) {
  Rng rng(7);
  std::vector<Tensor> ts;
  double expected = 0;
  for (int64_t i = 0; i < 40; ++i) {
    const int64_t n = i % 7 == 3 ? 0 : (i * 3677) % 9001 + 1;
    std::vector<double> v(static_cast<size_t>(n));
    for (double& x : v) x = rng.normal();
    if (i % 2) {
      std::vector<float> f(v.begin(), v.end());
      for (float x : f) expected += static_cast<double>(x) * x;
      ts.push_back(Tensor::from<float>({n}, f));
    } else {
      for (double x : v) expected += x * x;
      ts.push_back(Tensor::from<double>({n}, v));
    }
  }
  const double got = ops::sum_of_squares(ts);
  EXPECT_NEAR(got, expected, 1e-12 * expected);
  EXPECT_EQ(ops::sum_of_squares(ts), got);
}

// Data-parallel ranks clip by the norm each computes: ranks with different thread counts must
// get the same bits, or their weights part after the first clipped step.
TEST(SumOfSquares, TheSameBitsOnAnyNumberOfThreads) {
  Rng rng(11);
  std::vector<float> v(300001);
  for (float& x : v) x = static_cast<float>(rng.normal());
  const std::vector<Tensor> ts = {Tensor::from<float>({static_cast<int64_t>(v.size())}, v),
                                  Tensor::from<float>({3}, {1.5f, -2.0f, 0.25f})};
  const int threads_before = num_threads();
  std::vector<double> sums;
  for (int threads : {1, 2, 3, 5}) {
    set_num_threads(threads);
    sums.push_back(ops::sum_of_squares(ts));
  }
  set_num_threads(threads_before);
  for (size_t i = 1; i < sums.size(); ++i) EXPECT_EQ(sums[i], sums[0]) << "thread count " << i;
}

// An inner dimension of 0 is an empty sum: c = beta c, zero when beta is 0 (whatever c held),
// in every transpose (BLAS refuses the leading dimension of 0 and left c untouched).
TEST(Gemm, AnEmptyInnerDimensionScalesC) {
  for (int trans = 0; trans < 4; ++trans) {
    const bool ta = trans & 1, tb = trans & 2;
    const Tensor a = Tensor::empty(ta ? Shape{0, 3} : Shape{3, 0}, DType::f32);
    const Tensor b = Tensor::empty(tb ? Shape{2, 0} : Shape{0, 2}, DType::f32);
    Tensor c = Tensor::from<float>({3, 2}, {1, 2, 3, 4, 5, std::nanf("")});
    ops::gemm(a, ta, b, tb, c, 0.7, 0.0);
    EXPECT_EQ(c.to_doubles(), std::vector<double>(6, 0.0)) << "trans " << trans;
    c = Tensor::from<float>({3, 2}, {1, 2, 3, 4, 5, 6});
    ops::gemm(a, ta, b, tb, c, 0.7, 0.5);
    EXPECT_EQ(c.to_doubles(), (std::vector<double>{0.5, 1, 1.5, 2, 2.5, 3})) << "trans " << trans;
  }
}

}  // namespace
}  // namespace pollen
