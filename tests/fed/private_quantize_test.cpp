// Distributed DP's quantisation (fed/secagg/private_quantize.h): the rounding held within its
// norm bound, the discrete Gaussian noise added to integers, and what a round is charged.
#include "fed/secagg/private_quantize.h"

#include <gtest/gtest.h>

#include <cmath>

#include "base/error.h"
#include "base/thread_pool.h"
#include "optim/privacy_accountant.h"

using namespace pollen;
using namespace pollen::fed::secagg;

namespace {

Options ring64(double step) {
  Options o;
  o.step = step;
  return o;
}

double norm_sq(const std::vector<uint64_t>& words) {
  double s = 0;
  for (uint64_t w : words) {
    const auto v = static_cast<double>(ring_signed(w, 64));
    s += v * v;
  }
  return s;
}

}  // namespace

TEST(PrivateQuantize, RoundingIsDrawnAgainUntilItsNormIsWithinTheBound) {
  // 64 values of half a step, and a norm bound of 0: D2^2 = 64 / 4 + 4 * 8 / 2 = 32, the mean of
  // the rounded norm^2 (each value rounds to 0 or 1), so about half the first draws pass it.
  const Options o = ring64(1.0 / 64);
  const Tensor half = Tensor::full({64}, 0.5f / 64, DType::f32);
  EXPECT_DOUBLE_EQ(rounded_norm_bound(0, 64, o), std::sqrt(32.0));
  int over_at_first = 0;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    // quantize() draws the same first rounding from the same seed.
    if (norm_sq(quantize({half}, 1, o, seed)) > 32) ++over_at_first;
    Rng noise(seed);
    const auto words = quantize_private({half}, 0, 0, o, seed, noise);
    EXPECT_LE(norm_sq(words), 32) << "seed " << seed;
  }
  EXPECT_GT(over_at_first, 50) << "the first draws should often exceed the bound";
  // Rounding to nearest moves each value by at most half a step: c' + sqrt(d) / 2.
  Options nearest = o;
  nearest.stochastic = false;
  EXPECT_DOUBLE_EQ(rounded_norm_bound(1, 64, nearest), 64 + 4);
  // ... and reaches it where c' is a half-integer (adaptive clipping's count of 1/2 at a step of
  // 1): a norm of exactly D2 is taken, not drawn again until the client fails.
  Options whole = ring64(1);
  whole.stochastic = false;
  Rng noise(1);
  const auto count =
      quantize_private({Tensor::full({1}, 0.5f, DType::f32)}, 0.5, 0, whole, 1, noise);
  EXPECT_EQ(norm_sq(count), 1);
  EXPECT_DOUBLE_EQ(rounded_norm_bound(0.5, 1, whole), 1);
  // A large norm: the bound's first form, c'^2 + d/4 + 4 (c' + sqrt(d)/2).
  EXPECT_DOUBLE_EQ(rounded_norm_bound(1, 64, o), std::sqrt(64.0 * 64 + 16 + 4 * (64 + 4)));
}

TEST(PrivateQuantize, TheNoiseIsADiscreteGaussianOnTheRoundedIntegers) {
  // Noise of std 3 steps (variance 9): the words minus the noiseless words are integers with
  // variance 9, and the rounding is the same with or without noise.
  const Options o = ring64(1.0 / 1024);
  Tensor v = Tensor::empty({20000}, DType::f32);
  Rng values(5);
  for (int64_t j = 0; j < v.numel(); ++j) v.data<float>()[j] = 0.001f * (values.uniform() - 0.5f);
  const Rng draws(1);
  const auto quiet = quantize_private({v}, 1, 0, o, 9, draws);
  const int threads = num_threads();
  set_num_threads(1);
  const auto noisy = quantize_private({v}, 1, 3.0 / 1024, o, 9, draws);
  set_num_threads(3);
  EXPECT_EQ(quantize_private({v}, 1, 3.0 / 1024, o, 9, draws), noisy)
      << "the noise must not depend on the threads";
  set_num_threads(threads);
  EXPECT_EQ(o.noise_variance(3.0 / 1024), 9u);
  EXPECT_EQ(o.noise_tail(3.0 / 1024), 60);
  double s = 0, s2 = 0;
  int64_t largest = 0;
  for (size_t j = 0; j < quiet.size(); ++j) {
    const int64_t e = ring_signed(noisy[j], 64) - ring_signed(quiet[j], 64);
    s += static_cast<double>(e);
    s2 += static_cast<double>(e * e);
    largest = std::max(largest, std::abs(e));
  }
  const auto n = static_cast<double>(quiet.size());
  EXPECT_NEAR(s / n, 0, 5 * 3 / std::sqrt(n));
  EXPECT_NEAR(s2 / n, 9, 9 * 5 * std::sqrt(2 / n));
  EXPECT_LT(largest, 30);
  // A variance past 2^56 steps^2 is refused, naming what to change.
  try {
    (void)o.noise_variance(1e6);
    ADD_FAILURE() << "a variance past the sampler's was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("secure_aggregation.step"), std::string::npos) << e.what();
  }
}

TEST(PrivateQuantize, ARoundIsChargedAHairAboveTheGaussianOfMultiplierZ) {
  // z = 1, C = 0.05 on 100k values, step 2^-24, up to 8 clients: the sum's std is 838861 steps,
  // the rounding adds d / 4 + 4 (c' + sqrt(d) / 2) to c'^2, and tau underflows.
  const Options o = ring64(0x1p-24);
  DistributedNoise central;
  central.clip = 0.05;
  central.stddev = 0.05;
  const auto rdp = release_rdp(o, central, 100000, 8);
  const double c = 0.05 * 0x1p24;
  const double inflation = (c * c + 25000 + 4 * (c + std::sqrt(1e5) / 2)) / (c * c);
  const auto& orders = optim::rdp_orders();
  for (size_t k = 0; k < orders.size(); ++k) {
    const double gaussian = optim::sampled_gaussian_rdp(1, 1.0, orders[k]);
    EXPECT_NEAR(rdp[k], gaussian * inflation, 1e-9 * gaussian);
    EXPECT_GT(rdp[k], gaussian);
  }
  EXPECT_LT(inflation, 1 + 1e-5);
  // Adaptive clipping adds the count's part: 2 D2(1/2) = 2 (c' + 1) for one value, over its std.
  central.count_stddev = 2;
  const auto both = release_rdp(o, central, 100000, 8);
  const double count_l2 = 2 * (0.5 * 0x1p24 + 1);
  for (size_t k = 0; k < orders.size(); ++k) {
    const double count = orders[k] / 2 * std::pow(count_l2 / (2 * 0x1p24), 2);
    EXPECT_NEAR(both[k] - rdp[k], count, 1e-9 * count);
  }
  // No noise, no privacy.
  central.stddev = 0;
  EXPECT_TRUE(std::isinf(release_rdp(o, central, 10, 2)[0]));
}
