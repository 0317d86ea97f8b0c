// The fused, row-blocked cross-entropy against a naive float64 softmax over full logits.
#include "ops/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "support/gradcheck.h"

namespace pollen {
namespace {

struct Naive {
  double loss = 0;
  std::vector<double> dh, dw;
};

Naive naive_cross_entropy(const Tensor& h, const Tensor& w, const std::vector<int32_t>& tg) {
  const int64_t n = h.size(0), c = h.size(1), v = w.size(0);
  const double* hp = h.data<double>();
  const double* wp = w.data<double>();
  Naive r;
  r.dh.assign(static_cast<size_t>(n * c), 0);
  r.dw.assign(static_cast<size_t>(v * c), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (tg[i] < 0) continue;
    std::vector<double> logit(v);
    double mx = -1e300;
    for (int64_t j = 0; j < v; ++j) {
      for (int64_t k = 0; k < c; ++k) logit[j] += hp[i * c + k] * wp[j * c + k];
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    for (double l : logit) sum += std::exp(l - mx);
    r.loss += mx + std::log(sum) - logit[tg[i]];
    for (int64_t j = 0; j < v; ++j) {
      double g = std::exp(logit[j] - mx) / sum - (j == tg[i] ? 1 : 0);
      for (int64_t k = 0; k < c; ++k) {
        r.dh[i * c + k] += g * wp[j * c + k];
        r.dw[j * c + k] += g * hp[i * c + k];
      }
    }
  }
  return r;
}

TEST(CrossEntropy, EveryBlockSizeMatchesNaiveLossAndGradients) {
  Rng rng(11);
  const int64_t n = 9, c = 5, v = 17;
  Tensor h = testing::random_tensor({n, c}, rng, 2.0), w = testing::random_tensor({v, c}, rng);
  std::vector<int32_t> tg = {3, 16, -100, 0, 0, 8, -1, 2, 16};
  Tensor targets = Tensor::from<int32_t>({n}, tg);
  const Naive want = naive_cross_entropy(h, w, tg);
  for (int64_t block : {1, 2, 4, 9, 100}) {
    ops::CrossEntropyGrads g;
    g.dh = Tensor::full({n, c}, 99.0, DType::f64);  // must be overwritten
    g.dw = Tensor::full({v, c}, 1.0, DType::f64);   // must be accumulated into
    int64_t scored = 0;
    double loss = ops::cross_entropy_forward(h, w, targets, &scored, &g, block);
    EXPECT_EQ(scored, 7);
    EXPECT_NEAR(loss, want.loss, 1e-12) << "block " << block;
    auto dh = g.dh.to_doubles(), dw = g.dw.to_doubles();
    for (size_t i = 0; i < dh.size(); ++i) EXPECT_NEAR(dh[i], want.dh[i], 1e-12);
    for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], want.dw[i] + 1.0, 1e-12);
    // A frozen head's dw is not asked for: dh and the loss are the same without it.
    ops::CrossEntropyGrads no_dw;
    no_dw.dh = Tensor::full({n, c}, 99.0, DType::f64);
    EXPECT_EQ(ops::cross_entropy_forward(h, w, targets, &scored, &no_dw, block), loss);
    EXPECT_EQ(no_dw.dh.to_doubles(), g.dh.to_doubles());
  }
}

TEST(CrossEntropy, Float32FollowsFloat64) {
  Rng rng(12);
  const int64_t n = 33, c = 24, v = 300;
  Tensor h = testing::random_tensor({n, c}, rng, 3.0), w = testing::random_tensor({v, c}, rng);
  std::vector<int32_t> tg(n);
  for (auto& t : tg) t = static_cast<int32_t>(rng.below(v));
  Tensor targets = Tensor::from<int32_t>({n}, tg);
  int64_t scored = 0;
  double l64 = ops::cross_entropy_forward(h, w, targets, &scored);
  double l32 = ops::cross_entropy_forward(h.to(DType::f32), w.to(DType::f32), targets, &scored);
  EXPECT_NEAR(l32, l64, 1e-5 * std::fabs(l64));
}

TEST(CrossEntropy, HandComputedUniformLogits) {
  // h = 0 gives equal logits: the loss of each scored row is log(V).
  Tensor h = Tensor::zeros({3, 2}, DType::f64), w = Tensor::full({4, 2}, 0.5, DType::f64);
  Tensor targets = Tensor::from<int32_t>({3}, {1, -100, 3});
  int64_t scored = 0;
  EXPECT_NEAR(ops::cross_entropy_forward(h, w, targets, &scored), 2 * std::log(4.0), 1e-15);
  EXPECT_EQ(scored, 2);
}

// A NaN logit anywhere in a scored row (not only in its first column) makes the loss NaN, as in
// PyTorch: a broken model's loss must not look finite. float32 is the fast exp's path.
TEST(CrossEntropy, ANanLogitMakesTheLossNan) {
  for (const int64_t bad : {0, 5, 299}) {
    Rng rng(13);
    const int64_t n = 4, c = 8, v = 300;
    Tensor h = testing::random_tensor({n, c}, rng).to(DType::f32);
    Tensor w = testing::random_tensor({v, c}, rng).to(DType::f32);
    w.data<float>()[bad * c + 2] = std::nanf("");  // column `bad` of every row's logits
    Tensor targets = Tensor::from<int32_t>({n}, {1, 2, 3, 4});
    int64_t scored = 0;
    EXPECT_TRUE(std::isnan(ops::cross_entropy_forward(h, w, targets, &scored))) << bad;
  }
}

TEST(CrossEntropy, TargetOutsideVocabularyIsAClearError) {
  Tensor h = Tensor::zeros({1, 2}, DType::f32), w = Tensor::zeros({4, 2}, DType::f32);
  Tensor targets = Tensor::from<int32_t>({1}, {4});
  int64_t scored = 0;
  try {
    ops::cross_entropy_forward(h, w, targets, &scored);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("target 4 at row 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pollen
