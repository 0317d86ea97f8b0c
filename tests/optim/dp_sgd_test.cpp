// DP-SGD's pieces: each example clipped on its own, the noise's scale, the Poisson sample, the
// noise calibrated to a target epsilon as Opacus calibrates it, and a resumed run's state.
#include "optim/dp_sgd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "support/errors.h"
#include "support/peer.h"

using namespace pollen;
using optim::add_gaussian_noise;
using optim::DpSgd;
using optim::DpSgdOptions;

namespace {

ag::Var param(const std::vector<float>& values) {
  return ag::Var(Tensor::from<float>({static_cast<int64_t>(values.size())}, values), true);
}

void set_grad(ag::Var& p, const std::vector<float>& values) {
  p.grad() = Tensor::from<float>({static_cast<int64_t>(values.size())}, values);
}

std::vector<float> grad_of(const ag::Var& p) {
  const float* g = p.grad().data<float>();
  return std::vector<float>(g, g + p.grad().numel());
}

DpSgdOptions options(double clip, double z, int64_t seed = 1) {
  DpSgdOptions o;
  o.enabled = true;
  o.clip = clip;
  o.noise_multiplier = z;
  o.noise_seed = seed;
  return o;
}

}  // namespace

TEST(DpSgd, EachExampleIsClippedOnItsOwnAndTheSumIsOverTheExpectedRows) {
  ag::Var a = param({0, 0}), b = param({0});
  DpSgd dp(options(1.0, 0.0), 100, 4, 10);
  dp.begin({a, b});
  // Norm 5 across both parameters: clipped to 1, so (0.6, 0.8 | 0).
  set_grad(a, {3, 4});
  set_grad(b, {0});
  EXPECT_NEAR(dp.add_clipped(), 5.0, 1e-12);
  // Norm 0.5: kept as it is.
  set_grad(a, {0.3f, 0});
  set_grad(b, {0.4f});
  EXPECT_NEAR(dp.add_clipped(), 0.5, 1e-7);
  // A non-finite gradient is left out (counted as clipped), not added as NaN.
  set_grad(a, {NAN, 1});
  set_grad(b, {0});
  EXPECT_TRUE(std::isnan(dp.add_clipped()));
  EXPECT_EQ(dp.clipped(), 2);
  dp.release(1);
  // (0.6 + 0.3, 0.8 | 0.4) over the 4 rows expected, not the 2 drawn: clipping the sum instead
  // would give (0.19, 0.19 | 0.02), dividing by the rows drawn twice these.
  const std::vector<float> ga = grad_of(a), gb = grad_of(b);
  EXPECT_NEAR(ga[0], 0.9 / 4, 1e-6);
  EXPECT_NEAR(ga[1], 0.8 / 4, 1e-6);
  EXPECT_NEAR(gb[0], 0.4 / 4, 1e-6);
  EXPECT_EQ(dp.steps_accounted(), 1);
}

TEST(DpSgd, TheNoiseOnTheGradientHasStdZTimesClipOverTheExpectedRows) {
  const int64_t n = 200000;
  ag::Var w(Tensor::zeros({n}, DType::f32), true);
  const double clip = 0.5, z = 2.0, rows = 10;
  DpSgd dp(options(clip, z), 1000, static_cast<int64_t>(rows), 10);
  dp.begin({w});
  dp.release(3);  // no sequence drawn: noise alone
  const float* g = w.grad().data<float>();
  double sum = 0, squares = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += g[i];
    squares += static_cast<double>(g[i]) * g[i];
  }
  const double want = z * clip / rows;  // 0.1
  const double mean = sum / n, std = std::sqrt(squares / n - mean * mean);
  EXPECT_NEAR(std, want, 0.01 * want);
  EXPECT_NEAR(mean, 0.0, 5 * want / std::sqrt(static_cast<double>(n)));
  // One Poisson-sampled Gaussian of multiplier z at q = 10 / 1000 accounted.
  optim::PrivacyAccountant one;
  one.add(0.01, z);
  EXPECT_DOUBLE_EQ(dp.epsilon().epsilon, one.epsilon(dp.delta()).epsilon);
  // The default delta: 1e-5, or 0.1 / N when that is smaller.
  EXPECT_DOUBLE_EQ(dp.delta(), 1e-5);
  EXPECT_DOUBLE_EQ(DpSgd(options(clip, z), 1000000, 10, 10).delta(), 1e-7);
}

// Secure noise (Opacus's secure_mode): each value is four independent normal draws summed over 2
// (the first of each of four Box-Muller pairs of the plain stream: the two of one pair sum to a
// single draw of its two uniforms), so it keeps the std while no single draw's low bits show;
// split over tensors and threads as the plain draws are.
TEST(DpSgd, SecureNoiseIsFourDrawsOfThePlainStreamSummedOverTwo) {
  const int64_t n = 100001;
  std::vector<Tensor> plain{Tensor::zeros({8 * n - 5}, DType::f32), Tensor::zeros({5}, DType::f32)};
  std::vector<Tensor> secure{Tensor::zeros({n - 2}, DType::f32), Tensor::zeros({2}, DType::f32)};
  add_gaussian_noise(plain, 1.0, 42, 7);
  add_gaussian_noise(secure, 1.0, 42, 7, true);
  const auto value = [](const std::vector<Tensor>& ts, int64_t i) {
    for (const Tensor& t : ts) {
      if (i < t.numel()) return static_cast<double>(t.data<float>()[i]);
      i -= t.numel();
    }
    return std::nan("");
  };
  double squares = 0;
  for (int64_t j = 0; j < n; ++j) {
    double want = 0;
    for (int64_t k = 0; k < 4; ++k) want += value(plain, 8 * j + 2 * k);
    want /= 2;
    ASSERT_NEAR(value(secure, j), want, 1e-6 * (1 + std::abs(want))) << "value " << j;
    squares += value(secure, j) * value(secure, j);
  }
  EXPECT_NEAR(std::sqrt(squares / n), 1.0, 0.01);
  // And through DP-SGD's options.
  DpSgdOptions o = options(1.0, 1.0, 42);
  o.secure_noise = true;
  ag::Var w(Tensor::zeros({8}, DType::f32), true), v(Tensor::zeros({8}, DType::f32), true);
  DpSgd a(o, 100, 1, 10), b(options(1.0, 1.0, 42), 100, 1, 10);
  a.begin({w});
  a.release(1);
  b.begin({v});
  b.release(1);
  EXPECT_NE(w.grad().to_doubles(), v.grad().to_doubles());
}

TEST(DpSgd, ThePoissonSampleDrawsEachSequenceOnItsOwnAtRateQ) {
  const int64_t records = 500, expected = 50, steps = 2000;
  const double q = 0.1;
  DpSgd dp(options(1.0, 1.0, 9), records, expected, steps);
  EXPECT_DOUBLE_EQ(dp.sampling_rate(), q);
  std::vector<int64_t> counts(records, 0);
  double sum = 0, squares = 0;
  for (int64_t step = 1; step <= steps; ++step) {
    const std::vector<int64_t> s = dp.sample(step);
    for (size_t i = 0; i < s.size(); ++i) {
      ASSERT_TRUE(s[i] >= 0 && s[i] < records);
      if (i > 0) ASSERT_LT(s[i - 1], s[i]) << "ascending, each sequence at most once";
      ++counts[static_cast<size_t>(s[i])];
    }
    sum += static_cast<double>(s.size());
    squares += static_cast<double>(s.size() * s.size());
  }
  // The sample's size is Binomial(N, q): mean 50, variance 45 (a fixed-size sample has none).
  const double mean = sum / steps, variance = squares / steps - mean * mean;
  EXPECT_NEAR(mean, records * q, 4 * std::sqrt(records * q * (1 - q) / steps));
  EXPECT_NEAR(variance, records * q * (1 - q), 0.1 * records * q * (1 - q));
  // Every sequence is drawn at rate q: within 5 sigma of 200 times in 2000 steps.
  const double sigma = std::sqrt(steps * q * (1 - q));
  for (int64_t c : counts) EXPECT_NEAR(static_cast<double>(c), steps * q, 5 * sigma);
  // With a seed the draw repeats; without one, each comes from the OS's CSPRNG.
  EXPECT_EQ(dp.sample(7), dp.sample(7));
  EXPECT_NE(dp.sample(7), dp.sample(8));
  DpSgd secret(options(1.0, 1.0, -1), records, expected, steps);
  EXPECT_NE(secret.sample(7), secret.sample(7));
}

TEST(DpSgd, TargetEpsilonSetsTheNoiseAsOpacusDoes) {
  const std::string missing = peer::missing("opacus");
  if (!missing.empty()) GTEST_SKIP() << missing;
  struct Setting {
    double epsilon, delta, rate;
    int64_t steps;
  };
  const std::vector<Setting> grid = {
      {8, 1e-5, 0.01, 1000}, {1, 1e-5, 0.05, 200}, {3, 1e-6, 0.001, 10000}, {0.5, 1e-5, 1, 5}};
  nlohmann::json input;
  for (const auto& s : grid)
    input["settings"].push_back(
        {{"epsilon", s.epsilon}, {"delta", s.delta}, {"rate", s.rate}, {"steps", s.steps}});
  const auto theirs = peer::run("optim/opacus_noise_reference.py", input, "opacus_noise");
  ASSERT_EQ(theirs.size(), grid.size());
  for (size_t g = 0; g < grid.size(); ++g) {
    const Setting& s = grid[g];
    const double z = optim::calibrate_noise_multiplier({}, s.epsilon, s.delta, s.rate, s.steps);
    const std::string where = cat("epsilon ", s.epsilon, " rate ", s.rate, " steps ", s.steps);
    EXPECT_NEAR(z, theirs[g]["noise_multiplier"].get<double>(), 5e-3 * z) << where;
    const auto epsilon_at = [&](double noise) {
      optim::PrivacyAccountant a;
      a.add(s.rate, noise, s.steps);
      return a.epsilon(s.delta).epsilon;
    };
    EXPECT_LE(epsilon_at(z), s.epsilon) << where;
    EXPECT_GT(epsilon_at(0.995 * z), s.epsilon) << where << ": not the smallest noise";
  }
  // A run asking for it reaches the target at its last step; an impossible one is refused.
  DpSgdOptions o = options(1.0, 0.0);
  o.target_epsilon = 2;
  o.delta = 1e-5;
  const DpSgd dp(o, 10000, 100, 500);
  EXPECT_LE(dp.epsilon_after(500).epsilon, 2.0);
  EXPECT_GT(dp.epsilon_after(500).epsilon, 1.95);
  o.target_epsilon = 1e-4;
  EXPECT_NE(
      pollen::testing::error_of([&] { DpSgd(o, 100, 100, 100000); }).find("cannot be reached"),
      std::string::npos);
}

TEST(DpSgd, AResumedRunKeepsItsNoiseAndItsAccountant) {
  DpSgdOptions o = options(1.0, 0.0);
  o.target_epsilon = 4;
  o.delta = 1e-5;
  ag::Var w = param({0});
  DpSgd first(o, 1000, 20, 100);
  for (int64_t step = 1; step <= 30; ++step) {
    first.begin({w});
    first.release(step);
  }
  const nlohmann::json saved = first.state();
  // The same run resumed: the same z and epsilon.
  DpSgd same(o, 1000, 20, 100);
  same.load_state(saved, 100, 30);
  EXPECT_EQ(same.noise_multiplier(), first.noise_multiplier());
  EXPECT_EQ(same.epsilon().epsilon, first.epsilon().epsilon);
  EXPECT_EQ(same.steps_accounted(), 30);
  // Steps released after the checkpoint (a crash): they stay accounted and z is calibrated
  // again for the steps left; an account that merely holds such steps from an earlier recovery
  // (its checkpoint saved after it) keeps its z, so that every later resume is bitwise.
  DpSgd recovered(o, 1000, 20, 100);
  recovered.load_state(saved, 100, 25, true);
  EXPECT_GT(recovered.noise_multiplier(), first.noise_multiplier());
  DpSgd later(o, 1000, 20, 100);
  later.load_state(saved, 100, 25);
  EXPECT_EQ(later.noise_multiplier(), first.noise_multiplier());
  // Resumed with more steps: the noise rises so that the last step still reaches the target.
  DpSgd longer(o, 1000, 20, 200);
  longer.load_state(saved, 200, 30);
  EXPECT_GT(longer.noise_multiplier(), first.noise_multiplier());
  EXPECT_LE(longer.epsilon_after(170).epsilon, 4.0);
  EXPECT_GT(longer.epsilon_after(170).epsilon, 3.9);
  // With noise_multiplier the configured z is taken, not the saved one; an account kept at
  // another clip is refused.
  DpSgd louder(options(1.0, 0.5), 1000, 20, 100);
  louder.load_state(saved, 100, 30);
  EXPECT_EQ(louder.noise_multiplier(), 0.5);
  EXPECT_EQ(louder.steps_accounted(), 30);
  DpSgd other_clip(options(2.0, 0.5), 1000, 20, 100);
  EXPECT_NE(pollen::testing::error_of([&] {
              other_clip.restore_accountant(saved);
            }).find("accounted at clip 1"),
            std::string::npos);
  // Without noise every order's RDP is infinite, which JSON writes as null: it reads back.
  DpSgd clip_only(options(1.0, 0.0), 1000, 20, 100);
  clip_only.begin({w});
  clip_only.release(1);
  DpSgd reread(options(1.0, 0.0), 1000, 20, 100);
  reread.load_state(nlohmann::json::parse(clip_only.state().dump()), 100, 1);
  EXPECT_EQ(reread.steps_accounted(), 1);
  EXPECT_TRUE(std::isinf(reread.epsilon().epsilon));
  EXPECT_NE(pollen::testing::error_of([&] {
              same.load_state({{"rdp", {1.0}}}, 100, 30);
            }).find("privacy state: expected {rdp, steps}"),
            std::string::npos);
}
