// The AdamW optimizer class around the fused update: global-norm clipping, a non-finite norm
// that leaves everything as it was, and weight decay only where asked. (The update rule itself
// is tested against PyTorch's in tests/ops/small_ops_test.cpp.)
#include "optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace pollen {
namespace {

ag::Var param(const std::vector<double>& values) {
  return ag::Var(Tensor::from<double>({static_cast<int64_t>(values.size())}, values), true);
}

void set_grad(ag::Var& p, const std::vector<double>& values) {
  p.grad() = Tensor::from<double>({static_cast<int64_t>(values.size())}, values);
}

// Gradients of global norm 10 (6 and 8 in two tensors) clipped to norm 1: the first moment after
// one step is (1 - beta1) times the clipped gradient, and step returns the norm before clipping.
TEST(AdamW, ClipsByTheGlobalNormOfAllGradients) {
  ag::Var a = param({1, 2}), b = param({3});
  optim::AdamWOptions o;
  o.max_grad_norm = 1.0;
  o.weight_decay = 0;
  optim::AdamW opt({a, b}, o);
  set_grad(a, {6, 0});
  set_grad(b, {8});
  EXPECT_DOUBLE_EQ(opt.step(1e-2), 10.0);
  const double scale = 1.0 / (10.0 + 1e-6);
  const auto m_a = opt.slots()[0].exp_avg.to_doubles(), m_b = opt.slots()[1].exp_avg.to_doubles();
  EXPECT_NEAR(m_a[0], 0.1 * 6 * scale, 1e-15);
  EXPECT_EQ(m_a[1], 0.0);
  EXPECT_NEAR(m_b[0], 0.1 * 8 * scale, 1e-15);
  // Under the bound nothing is scaled.
  opt.zero_grad();
  set_grad(a, {0.3, 0});
  set_grad(b, {0.4});
  EXPECT_DOUBLE_EQ(opt.step(1e-2), 0.5);
  EXPECT_NEAR(opt.slots()[1].exp_avg.to_doubles()[0], 0.9 * 0.1 * 8 * scale + 0.1 * 0.4, 1e-15);
}

// A NaN or infinite gradient changes nothing: weights, moments and the step count stay, and the
// norm comes back for the caller to report.
TEST(AdamW, ANonFiniteNormChangesNothing) {
  ag::Var a = param({1, 2});
  optim::AdamW opt({a}, {});
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    set_grad(a, {0.5, bad});
    EXPECT_FALSE(std::isfinite(opt.step(1e-2)));
    EXPECT_EQ(a.value().to_doubles(), (std::vector<double>{1, 2}));
    EXPECT_EQ(opt.slots()[0].exp_avg.to_doubles(), (std::vector<double>{0, 0}));
    EXPECT_EQ(opt.slots()[0].exp_avg_sq.to_doubles(), (std::vector<double>{0, 0}));
    EXPECT_EQ(opt.steps_taken(), 0);
  }
}

// Decoupled weight decay shrinks only the parameters marked for it, by lr * weight_decay, even
// where the gradient is zero (Adam's own step is then zero).
TEST(AdamW, WeightDecayOnlyWhereAsked) {
  ag::Var decayed = param({2, -4}), kept = param({2, -4});
  optim::AdamWOptions o;
  o.weight_decay = 0.5;
  optim::AdamW opt({decayed, kept}, o, {true, false});
  set_grad(decayed, {0, 0});
  set_grad(kept, {0, 0});
  opt.step(0.1);
  EXPECT_EQ(kept.value().to_doubles(), (std::vector<double>{2, -4}));
  const auto d = decayed.value().to_doubles();
  EXPECT_NEAR(d[0], 2 * (1 - 0.1 * 0.5), 1e-15);
  EXPECT_NEAR(d[1], -4 * (1 - 0.1 * 0.5), 1e-15);
}

// Over three steps each update bias-corrects with its own step count (PyTorch's AdamW, by hand in
// double): an optimizer that passed the same count every step would match only the first.
TEST(AdamW, EachStepBiasCorrectsWithItsOwnCount) {
  ag::Var a = param({1.0});
  optim::AdamWOptions o;
  o.max_grad_norm = 0;
  o.weight_decay = 0.1;
  optim::AdamW opt({a}, o, {true});
  const double lr = 1e-2, b1 = o.beta1, b2 = o.beta2;
  double p = 1.0, m = 0, v = 0;
  int t = 0;
  for (double g : {0.5, -0.2, 0.1}) {
    opt.zero_grad();
    set_grad(a, {g});
    opt.step(lr);
    ++t;
    p *= 1 - lr * o.weight_decay;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    p -= lr / (1 - std::pow(b1, t)) * m / (std::sqrt(v) / std::sqrt(1 - std::pow(b2, t)) + o.eps);
    EXPECT_NEAR(a.value().to_doubles()[0], p, 1e-12) << "step " << t;
  }
  EXPECT_EQ(opt.steps_taken(), 3);
}

}  // namespace
}  // namespace pollen
