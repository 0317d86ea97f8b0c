// The federation's differential privacy (its accountant: tests/optim/privacy_accountant_test.cpp):
// clipping, noise and the fixed denominator of central DP by hand, which analysis a fixed-size
// sample is accounted by, adaptive clipping's geometric step, the budget refusing a round, local
// DP, and `pollen fed privacy`.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "base/config.h"
#include "base/error.h"
#include "fed/fixtures.h"
#include "fed/privacy.h"
#include "fed/secagg/private_quantize.h"
#include "support/errors.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

TEST(CentralDp, ClipsSumsAndDividesByTheClientsSelected) {
  // Noise 0: Delta = (clip(a, 1) + b) / m with m = 3 selected (one dropped): a = (3, 4) has norm
  // 5 and becomes (0.6, 0.8); b = (0.5, 0) stays.
  CentralDp c(central_dp(0.0, 1.0));
  const Weights like{vec({0, 0})};
  AggregationReport report;
  const Weights d =
      c.aggregate(1, like, {update("b", 10, {0.5f, 0}), update("a", 1000, {3, 4})}, 3, 6, &report);
  EXPECT_NEAR(d[0].data<float>()[0], (0.6 + 0.5) / 3, 1e-7);
  EXPECT_NEAR(d[0].data<float>()[1], 0.8 / 3, 1e-7);
  EXPECT_TRUE(report.clients["a"].clipped);
  EXPECT_FALSE(report.clients["b"].clipped);
  EXPECT_DOUBLE_EQ(report.clients["a"].norm, 5.0);
  EXPECT_EQ(report.clipped(), 1);
  EXPECT_DOUBLE_EQ(report.extra["sampling_rate"].get<double>(), 0.5);
  EXPECT_EQ(report.extra["private_rounds"].get<int64_t>(), 1);
}

TEST(CentralDp, CappedTokenWeights) {
  PrivacyOptions o = central_dp(0.0, 10.0);
  o.weighting = "capped_tokens";
  o.token_cap = 100;
  CentralDp c(o);
  // Weights min(1, t / 100): 0.5 and 1 (not 3): (0.5 * 2 + 1 * 4) / 2.
  const Weights d =
      c.aggregate(1, {vec({0})}, {update("a", 50, {2}), update("b", 300, {4})}, 2, 2, nullptr);
  EXPECT_NEAR(d[0].data<float>()[0], 2.5, 1e-7);
}

TEST(CentralDp, NoiseHasStdNoiseMultiplierTimesClipOverM) {
  CentralDp c(central_dp(1.5, 2.0));
  const int64_t n = 200000;
  const Weights like{Tensor::zeros({n}, DType::f32)};
  ClientUpdate u;
  u.client_id = "a";
  u.tokens = 1;
  u.delta.push_back(Tensor::zeros({n}, DType::f32));
  const Weights d = c.aggregate(1, like, {u}, 4, 4, nullptr);
  double s = 0, s2 = 0;
  for (int64_t j = 0; j < n; ++j)
    s += d[0].data<float>()[j], s2 += std::pow(d[0].data<float>()[j], 2);
  const double mean = s / n, std = std::sqrt(s2 / n - mean * mean);
  EXPECT_NEAR(std, 1.5 * 2.0 / 4, 0.01 * 0.75);
  EXPECT_NEAR(mean, 0, 5 * 0.75 / std::sqrt(n));
}

// A key of a mode that is off (the adaptive clip, capped token weights) is named in a warning,
// not ignored silently: the clip stays fixed, the weights uniform.
TEST(CentralDp, KeysOfAModeThatIsOffAreNamed) {
  for (const std::string key : {"target_quantile = 0.9", "clip_lr = 0.1",
                                "clipped_count_stddev = 3.0", "token_cap = 100"}) {
    auto table =
        ConfigTable::parse("noise_multiplier = 1.0\nclip = 1.0\n" + key + "\n", "privacy.toml");
    ::testing::internal::CaptureStderr();
    read_privacy_options(table);
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(said.find("which is off: ignored"), std::string::npos) << key << ": " << said;
  }
  auto adaptive = ConfigTable::parse(
      "noise_multiplier = 1.0\nclip = 1.0\nadaptive_clip = true\ntarget_quantile = 0.9\n",
      "privacy.toml");
  EXPECT_DOUBLE_EQ(read_privacy_options(adaptive).target_quantile, 0.9);
}

TEST(CentralDp, SecureNoiseIsFourDrawsOverTwoCentrallyAndLocally) {
  // secure_noise read from [privacy] and [local_dp]; the noise is then optim::add_gaussian_noise's
  // secure construction (tests/optim/dp_sgd_test.cpp checks it) on the same seed and stream:
  // round 1's sum takes stream 2, local DP's round its number.
  auto table = ConfigTable::parse(
      "[privacy]\nnoise_multiplier = 1.5\nclip = 2.0\nnoise_seed = 7\nsecure_noise = true\n"
      "[local_dp]\nnoise_multiplier = 2.0\nclip = 1.0\nnoise_seed = 3\nsecure_noise = true\n",
      "test.toml");
  auto privacy_table = table.table("privacy");
  auto local_table = table.table("local_dp");
  const PrivacyOptions central = read_privacy_options(*privacy_table);
  const LocalDpOptions local = read_local_dp_options(*local_table);
  ASSERT_TRUE(central.secure_noise);
  ASSERT_TRUE(local.secure_noise);
  const int64_t n = 1000;
  ClientUpdate u;
  u.client_id = "a";
  u.tokens = 1;
  u.delta.push_back(Tensor::zeros({n}, DType::f32));
  CentralDp c(central);
  const Weights d = c.aggregate(1, {Tensor::zeros({n}, DType::f32)}, {u}, 4, 4, nullptr);
  std::vector<Tensor> want{Tensor::zeros({n}, DType::f32)};
  optim::add_gaussian_noise(want, 1.5 * 2.0, 7, 2, true);
  std::vector<Tensor> plain{Tensor::zeros({n}, DType::f32)};
  optim::add_gaussian_noise(plain, 1.5 * 2.0, 7, 2, false);
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_FLOAT_EQ(d[0].data<float>()[j], want[0].data<float>()[j] / 4) << j;
  }
  EXPECT_NE(d[0].data<float>()[0], plain[0].data<float>()[0] / 4);
  LocalDp l(local);
  Weights z{Tensor::zeros({n}, DType::f32)};
  l.apply(z, 5);
  std::vector<Tensor> local_want{Tensor::zeros({n}, DType::f32)};
  optim::add_gaussian_noise(local_want, 2.0, 3, 5, true);
  for (int64_t j = 0; j < n; ++j) EXPECT_EQ(z[0].data<float>()[j], local_want[0].data<float>()[j]);
}

TEST(CentralDp, AdaptiveClipFollowsTheTargetQuantileGeometrically) {
  PrivacyOptions o = central_dp(0.0, 1.0);
  o.adaptive_clip = true;
  o.target_quantile = 0.5;
  o.clip_lr = 0.2;
  o.clipped_count_stddev = 1e-9;  // the count's noise out of the way
  CentralDp c(o);
  const Weights like{vec({0})};
  // One of four updates within C = 1: b = 0.25, C <- exp(-0.2 (0.25 - 0.5)) = e^0.05.
  c.aggregate(
      1, like,
      {update("a", 1, {0.5f}), update("b", 1, {2}), update("c", 1, {3}), update("d", 1, {4})}, 4, 4,
      nullptr);
  EXPECT_NEAR(c.clip(), std::exp(0.05), 1e-6);
  // Over rounds it settles between the two middle norms (the median).
  for (int r = 2; r <= 200; ++r) {
    c.aggregate(
        r, like,
        {update("a", 1, {0.5f}), update("b", 1, {2}), update("c", 1, {3}), update("d", 1, {4})}, 4,
        4, nullptr);
  }
  EXPECT_GT(c.clip(), 1.9);
  EXPECT_LT(c.clip(), 3.1);
}

// The released count of unclipped updates has sensitivity 1/2, as the noise split assumes: one
// client more or fewer, clipped or not, moves it by exactly 1/2 (uncentred, by 1).
TEST(CentralDp, OneClientMovesTheReleasedCountByAHalf) {
  PrivacyOptions o = central_dp(0.0, 1.0);
  o.adaptive_clip = true;
  o.clipped_count_stddev = 1e-9;  // the count's noise out of the way
  const Weights like{vec({0})};
  auto released_count = [&](const std::vector<ClientUpdate>& updates) {
    CentralDp c(o);
    AggregationReport report;
    c.aggregate(1, like, updates, 4, 4, &report);
    return (report.extra["noised_unclipped_fraction"].get<double>() - 0.5) * 4;
  };
  const auto inside = update("a", 1, {0.5f}), outside = update("b", 1, {3});
  const double both = released_count({inside, outside});
  EXPECT_NEAR(std::abs(released_count({inside}) - both), 0.5, 1e-6);
  EXPECT_NEAR(std::abs(released_count({outside}) - both), 0.5, 1e-6);
}

TEST(CentralDp, AdaptiveNoiseSplitKeepsTheTotalMultiplier) {
  // z_sum = (z^-2 - (2 sigma_b)^-2)^-1/2; refused when z >= 2 sigma_b.
  PrivacyOptions o = central_dp(1.0, 1.0);
  o.adaptive_clip = true;
  o.clipped_count_stddev = 2.0;
  CentralDp c(o);
  AggregationReport report;
  c.aggregate(1, {vec({0})}, {update("a", 1, {1})}, 1, 1, &report);
  EXPECT_NEAR(report.extra["sum_noise_multiplier"].get<double>(), 1 / std::sqrt(1 - 1.0 / 16),
              1e-12);
  o.clipped_count_stddev = 0.4;  // 2 sigma_b = 0.8 < z
  CentralDp refused(o);
  EXPECT_NE(refused.refuse_round(1, 4, 8).find("clipped_count_stddev"), std::string::npos);
}

TEST(CentralDp, AFixedSampleTakesTheTighterOfTheGaussianAndSamplingWithoutReplacement) {
  CentralDp c(central_dp(1.0, 1.0));
  const Weights like{vec({0})};
  AggregationReport whole, half;
  // 2 of 2: no sampling, one client's update there or not moves the sum by C: multiplier z.
  c.aggregate(1, like, {update("a", 1, {1}), update("b", 1, {-1})}, 2, 2, &whole);
  PrivacyAccountant expected = PrivacyAccountant().after(1.0, 1.0);
  EXPECT_DOUBLE_EQ(whole.extra["epsilon"].get<double>(), expected.epsilon(1e-5).epsilon);
  // 1 of 2: amplification without replacement (proven for a replaced client, 2C: z / 2) is
  // looser at every order than the Gaussian of multiplier z that holds given any sample, so a
  // half sample costs what a whole one does, not more.
  c.aggregate(2, like, {update("a", 1, {1})}, 1, 2, &half);
  expected.add(1.0, 1.0);
  EXPECT_DOUBLE_EQ(half.extra["epsilon"].get<double>(), expected.epsilon(1e-5).epsilon);
  EXPECT_LT(half.extra["epsilon"].get<double>(),
            PrivacyAccountant()
                .after(1.0, 1.0)
                .after(0.5, 0.5, 1, Sampling::without_replacement)
                .epsilon(1e-5)
                .epsilon);
  // A small sample over many rounds: sampling is the tighter at the low orders and the Gaussian
  // at the high ones, and the order-wise minimum beats each bound alone.
  const double both = after_central_releases({}, "fixed", 0.01, 1.1, 1000).epsilon(1e-5).epsilon;
  const double sampled = PrivacyAccountant()
                             .after(0.01, 0.55, 1000, Sampling::without_replacement)
                             .epsilon(1e-5)
                             .epsilon;
  const double gaussian = PrivacyAccountant().after(1.0, 1.1, 1000).epsilon(1e-5).epsilon;
  EXPECT_LE(both, sampled);
  EXPECT_LT(both, gaussian);
}

TEST(DistributedDp, EachClientsShareIsTheCentralNoiseOverRootKAndNoSamplingIsClaimed) {
  PrivacyOptions o = central_dp(1.2, 0.5);
  o.weighting = "capped_tokens";
  o.token_cap = 300;
  CentralDp c(o, 1, true);
  // Shares for a sum of at least 4 inputs: 1.2 * 0.5 / 2 each, so 4 of them add up to z C.
  const secagg::DistributedNoise noise = c.distributed_noise(4, 6);
  EXPECT_DOUBLE_EQ(noise.clip, 0.5);
  EXPECT_DOUBLE_EQ(noise.stddev, 0.3);
  EXPECT_EQ(noise.token_cap, 300);
  EXPECT_EQ(noise.seed, 7);
  EXPECT_EQ(noise.count_stddev, 0) << "a fixed clip sends no count";
  // 6 of 20 available selected, 5 inputs in the sum: the server knows whom it selected, so the
  // round is charged what the release costs with no sampling (q = 1), here the Gaussian mechanism
  // of multiplier z (the discrete Gaussian's cost, secagg::release_rdp, is a hair above it), with
  // more noise than z C in the sum.
  AggregationReport report;
  const PrivacyAccountant gaussian = PrivacyAccountant().after(1.0, 1.2);
  c.account_distributed(6, 20, 5, noise, gaussian.rdp(), &report);
  EXPECT_DOUBLE_EQ(report.extra["epsilon"].get<double>(), gaussian.epsilon(1e-5).epsilon);
  EXPECT_EQ(report.extra["noise"], "discrete_gaussian");
  EXPECT_DOUBLE_EQ(report.extra["sampling_rate"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(report.extra["sum_noise_multiplier"].get<double>(), 0.3 * std::sqrt(5.0) / 0.5);
  EXPECT_DOUBLE_EQ(report.extra["expected_clients"].get<double>(), 6.0);
  EXPECT_EQ(report.extra["private_rounds"].get<int64_t>(), 1);
  // Poisson samples are not offered with secure aggregation.
  EXPECT_THROW(CentralDp(central_dp(1.0, 1.0, "poisson"), 0.5, true), Error);
  // Adaptive clipping: the count's share sigma_b / sqrt(k), and the update's z_Delta C / sqrt(k)
  // with z_Delta = (z^-2 - sigma_b^-2)^(-1/2): a real update against a zero one moves the count
  // by 1 (centrally one client present or absent moves it by 1/2, and 2 sigma_b stands there),
  // so the two releases cost multiplier z.
  PrivacyOptions adaptive = central_dp(1.0, 0.5);
  adaptive.adaptive_clip = true;
  adaptive.clipped_count_stddev = 2.0;
  const CentralDp a(adaptive, 1, true);
  const secagg::DistributedNoise shares = a.distributed_noise(4, 6);
  EXPECT_DOUBLE_EQ(shares.count_stddev, 2.0 / 2);
  EXPECT_DOUBLE_EQ(shares.stddev, std::pow(1.0 - 1.0 / 4, -0.5) * 0.5 / 2);
  // z must stay below sigma_b (centrally below 2 sigma_b): 1.5 against sigma_b 1 passes the
  // central check only.
  PrivacyOptions loud = adaptive;
  loud.noise_multiplier = 1.5;
  loud.clipped_count_stddev = 1.0;
  EXPECT_NE(CentralDp(loud, 1, true).refuse_round(1, 6, 6).find("clipped_count_stddev above 1.5"),
            std::string::npos);
  EXPECT_EQ(CentralDp(loud).refuse_round(1, 6, 6), "");
}

TEST(CentralDp, BudgetRefusesTheRoundThatWouldPassIt) {
  PrivacyOptions o = central_dp(1.0, 1.0);
  // A fixed-size sample, 2 of 4: the Gaussian of multiplier z is the tighter bound at every
  // order here (sampling without replacement, one client replaced, would be z / 2 at rate 1/2).
  PrivacyAccountant two;
  two.add(1.0, 1.0, 2);
  o.epsilon_budget = two.epsilon(o.delta).epsilon + 1e-9;  // room for exactly two rounds
  CentralDp c(o);
  const Weights like{vec({0})};
  for (int r = 1; r <= 2; ++r) {
    EXPECT_EQ(c.refuse_round(r, 2, 4), "");
    c.aggregate(r, like, {update("a", 1, {1})}, 2, 4, nullptr);
  }
  const std::string why = c.refuse_round(3, 2, 4);
  EXPECT_NE(why.find("privacy.epsilon_budget"), std::string::npos) << why;
  EXPECT_NE(why.find("round 3"), std::string::npos) << why;
  EXPECT_THROW(c.aggregate(3, like, {update("a", 1, {1})}, 2, 4, nullptr), Error);
  EXPECT_NEAR(c.epsilon().epsilon, two.epsilon(o.delta).epsilon, 1e-12);
}

TEST(CentralDp, StateRoundTrips) {
  PrivacyOptions o = central_dp(1.0, 1.0);
  o.adaptive_clip = true;
  o.clipped_count_stddev = 1.0;
  CentralDp a(o), b(o);
  a.aggregate(1, {vec({0})}, {update("a", 1, {3})}, 1, 2, nullptr);
  b.load_state(nlohmann::json::parse(a.state().dump()));
  EXPECT_EQ(b.clip(), a.clip());
  EXPECT_EQ(b.epsilon().epsilon, a.epsilon().epsilon);
  // Without noise every order's RDP is infinite, which JSON writes as null: read back as such.
  CentralDp open(central_dp(0.0, 1.0)), reopened(central_dp(0.0, 1.0));
  open.aggregate(1, {vec({0})}, {update("a", 1, {3})}, 1, 2, nullptr);
  reopened.load_state(nlohmann::json::parse(open.state().dump()));
  EXPECT_EQ(reopened.epsilon().epsilon, INFINITY);
  LocalDpOptions lo;
  lo.enabled = true;
  lo.clip = 1.0;
  LocalDp quiet(lo), requiet(lo);
  Weights w{vec({3, 4})};
  quiet.apply(w, 1);
  requiet.load_state(nlohmann::json::parse(quiet.state().dump()));
  EXPECT_EQ(requiet.epsilon().epsilon, INFINITY);
}

TEST(LocalDp, ClipsNoisesAndAccountsPerRound) {
  LocalDpOptions o;
  o.enabled = true;
  o.clip = 1.0;
  o.noise_multiplier = 0.0;
  LocalDp quiet(o);
  Weights w{vec({3, 4})};
  EXPECT_TRUE(quiet.apply(w, 1));
  EXPECT_NEAR(w[0].data<float>()[0], 0.6, 1e-7);
  EXPECT_NEAR(w[0].data<float>()[1], 0.8, 1e-7);

  // The noise's standard deviation is z times the clip: 2 * 0.5 (not z alone, nor z * clip^2).
  o.noise_multiplier = 2.0;
  o.noise_seed = 3;
  o.clip = 0.5;
  LocalDp noisy(o);
  const int64_t n = 100000;
  Weights z{Tensor::zeros({n}, DType::f32)};
  noisy.apply(z, 1);
  noisy.apply(w, 2);
  double s2 = 0;
  for (int64_t j = 0; j < n; ++j) s2 += std::pow(z[0].data<float>()[j], 2);
  EXPECT_NEAR(std::sqrt(s2 / n), 1.0, 0.01);
  PrivacyAccountant two;
  two.add(1.0, 2.0, 2);
  EXPECT_DOUBLE_EQ(noisy.epsilon().epsilon, two.epsilon(1e-5).epsilon);
}

TEST(PrivacyCli, PrintsTheAccountantsEpsilon) {
  // The server's default sampling (fixed: without replacement, multiplier z / 2), then Poisson.
  for (const std::string sampling : {"", "poisson"}) {
    int status = 0;
    const std::string out = pollen::testing::run_capture(
        std::string(POLLEN_BINARY) +
            " fed privacy --noise-multiplier 1.1 --sampling-rate 0.01 --rounds 1000 --delta 1e-5" +
            (sampling.empty() ? "" : " --sampling " + sampling),
        &status);
    ASSERT_EQ(status, 0) << out;
    PrivacyAccountant a;
    if (sampling.empty()) {
      a.add(0.01, 0.55, 1000, Sampling::without_replacement);
    } else {
      a.add(0.01, 1.1, 1000);
    }
    char expect[64];
    std::snprintf(expect, sizeof expect, "%-8d %-12.6g", 1000, a.epsilon(1e-5).epsilon);
    EXPECT_NE(out.find(expect), std::string::npos) << sampling << "\n" << out;
  }
}

TEST(PrivacyCli, AGivenValueIsCheckedNeverTakenForNotGiven) {
  // -1 and 0 are values a user gave: refused as such, not read as "the option is missing".
  for (const auto& [option, expect] :
       {std::pair<std::string, std::string>{"--noise-multiplier -1",
                                            "--noise-multiplier must be 0 or more, got -1"},
        {"--target-epsilon 0", "--target-epsilon must be positive and finite, got 0"},
        // Not the central accounting with --clip and --clients left unused.
        {"--noise-multiplier 1 --values 0 --clip 1 --clients 3",
         "'0': expected a number of 1 or more"},
        {"", "give --noise-multiplier or --target-epsilon"}}) {
    int status = 0;
    const std::string out = pollen::testing::run_capture(
        std::string(POLLEN_BINARY) + " fed privacy --sampling-rate 0.01 --rounds 10 " + option,
        &status);
    EXPECT_NE(status, 0) << option;
    EXPECT_NE(out.find(expect), std::string::npos) << option << "\n" << out;
  }
  int status = 0;
  const std::string step = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) +
          " fed privacy --noise-multiplier 1 --sampling-rate 1 --rounds 10 --values 1000 --clip 1 "
          "--clients 3 --step 10",
      &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(step.find("--step: must be positive and at most the range of a value (1), got 10"),
            std::string::npos)
      << step;
}

TEST(PrivacyCli, AccountsDistributedDpsDiscreteGaussian) {
  // A small clip on a large model: the rounding grows the update's norm bound (c = 0.001 / 2^-24
  // = 16777 steps, d = 10^9 values: D2^2 / c^2 = 1 + d / (4 c^2) + ... = 1.89), which the plain
  // Gaussian of multiplier z leaves out.
  int status = 0;
  const std::string out = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) +
          " fed privacy --noise-multiplier 1 --sampling-rate 1 --rounds 100 --values 1000000000 "
          "--clip 0.001 --clients 20",
      &status);
  ASSERT_EQ(status, 0) << out;
  secagg::Options o;
  secagg::DistributedNoise central;
  central.clip = 0.001;
  central.stddev = 0.001;
  std::vector<double> rdp = secagg::release_rdp(o, central, 1000000000, 20);
  for (double& v : rdp) v *= 100;
  const double discrete = optim::rdp_to_epsilon(rdp, 1e-5).epsilon;
  const double gaussian = PrivacyAccountant().after(1.0, 1.0, 100).epsilon(1e-5).epsilon;
  EXPECT_GT(discrete, 1.2 * gaussian);
  char expect[64];
  std::snprintf(expect, sizeof expect, "%-8d %-12.6g", 100, discrete);
  EXPECT_NE(out.find(expect), std::string::npos) << out;
  // With adaptive clipping the server splits z between the update (z_Delta) and the masked count
  // (sigma_b) so that the two cost what one Gaussian of multiplier z does: the plan is that
  // Gaussian's (a hair above), not the update's part alone, z_Delta = (z^-2 - sigma_b^-2)^-1/2.
  const std::string plan = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) +
          " fed privacy --noise-multiplier 0.8 --sampling-rate 1 --rounds 10 --values 100000 "
          "--clip 1 --clients 20 --adaptive-clip --clipped-count-stddev 2",
      &status);
  ASSERT_EQ(status, 0) << plan;
  const double split = std::stod(plan.substr(plan.find("\n10 ") + 4));
  const double whole = PrivacyAccountant().after(1.0, 0.8, 10).epsilon(1e-5).epsilon;
  const double update_alone = PrivacyAccountant()
                                  .after(1.0, std::pow(std::pow(0.8, -2) - 0.25, -0.5), 10)
                                  .epsilon(1e-5)
                                  .epsilon;
  EXPECT_NEAR(split, whole, whole * 1e-4) << plan;  // printed to six digits
  EXPECT_GT(split, update_alone * 1.05) << plan;
  // Where rounding grows the update's bound (clip 0.001 on 10^9 values: 1.89x the RDP) the split
  // shows: the growth falls on z_Delta's part only, so the plan is below the unsplit one's, and it
  // is the update's discrete Gaussian at z_Delta plus the count's at sigma_b.
  auto planned = [&](const std::string& adaptive) {
    const std::string said = pollen::testing::run_capture(
        std::string(POLLEN_BINARY) +
            " fed privacy --noise-multiplier 0.8 --sampling-rate 1 --rounds 10 --values "
            "1000000000 --clip 0.001 --clients 20 " +
            adaptive,
        &status);
    EXPECT_EQ(status, 0) << said;
    return std::stod(said.substr(said.find("\n10 ") + 4));
  };
  const double unsplit = planned(""), grown = planned("--adaptive-clip --clipped-count-stddev 2");
  central.clip = 0.001;
  central.stddev = 0.001 * std::pow(std::pow(0.8, -2) - 0.25, -0.5);
  central.count_stddev = 2;
  rdp = secagg::release_rdp(o, central, 1000000000, 20);
  for (double& v : rdp) v *= 10;
  const double expected = optim::rdp_to_epsilon(rdp, 1e-5).epsilon;
  EXPECT_NEAR(grown, expected, expected * 1e-5);
  EXPECT_LT(grown, unsplit * 0.97);
  // Refused, each saying what is wrong: a sample below every client or Poisson sampling (the
  // server knows whom it selected), a share past the sampler's 2^28 steps, and a distributed
  // option without --values.
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--noise-multiplier 1 --sampling-rate 0.5 --values 1000 --clip 1 --clients 20",
            "--sampling-rate 1"},
           {"--noise-multiplier 1 --sampling-rate 1 --sampling poisson --values 1000 --clip 1 "
            "--clients 20",
            "--sampling fixed"},
           {"--noise-multiplier 30 --sampling-rate 1 --values 1000 --clip 1 --clients 20",
            "raise secure_aggregation.step"},
           {"--noise-multiplier 1 --sampling-rate 1 --clip 1", "--clip requires --values"},
           {"--noise-multiplier 1 --sampling-rate 1 --values 1000 --clip 1 --clients 20 "
            "--adaptive-clip --clipped-count-stddev 0.5",
            "clipped_count_stddev above 1"}}) {
    const std::string said = pollen::testing::run_capture(
        std::string(POLLEN_BINARY) + " fed privacy --rounds 10 " + args, &status);
    EXPECT_NE(status, 0) << args;
    EXPECT_NE(said.find(says), std::string::npos) << args << "\n" << said;
  }
}

TEST(PrivacyCli, CalibratesTheNoiseMultiplierToATargetEpsilon) {
  // The smallest z, to 0.1%, whose epsilon after the rounds is at most the target: central with
  // Poisson sampling, and distributed DP's discrete Gaussian.
  auto calibrated = [](const std::string& args, std::string* out) {
    int status = 0;
    *out = pollen::testing::run_capture(
        std::string(POLLEN_BINARY) + " fed privacy --target-epsilon 8 " + args, &status);
    EXPECT_EQ(status, 0) << *out;
    const size_t at = out->find("noise multiplier ");
    EXPECT_NE(at, std::string::npos) << *out;
    EXPECT_NE(out->find("(for epsilon 8)"), std::string::npos) << *out;
    return std::stod(out->substr(at + 17));
  };
  std::string out;
  const double z = calibrated("--sampling-rate 0.01 --rounds 1000 --sampling poisson", &out);
  auto central = [](double noise) {
    return PrivacyAccountant().after(0.01, noise, 1000).epsilon(1e-5).epsilon;
  };
  EXPECT_LE(central(z), 8) << out;
  EXPECT_GT(central(z * 0.997), 8) << out;
  const double zd = calibrated(
      "--sampling-rate 1 --rounds 100 --values 1000000000 --clip 0.001 --clients 20", &out);
  auto distributed = [](double noise) {
    secagg::DistributedNoise whole;
    whole.clip = 0.001;
    whole.stddev = noise * 0.001;
    std::vector<double> rdp = secagg::release_rdp(secagg::Options{}, whole, 1000000000, 20);
    for (double& v : rdp) v *= 100;
    return optim::rdp_to_epsilon(rdp, 1e-5).epsilon;
  };
  EXPECT_LE(distributed(zd), 8) << out;
  EXPECT_GT(distributed(zd * 0.997), 8) << out;
  // Unreachable, and both or neither of the two ways to give z: refused, saying so.
  int status = 0;
  out = pollen::testing::run_capture(std::string(POLLEN_BINARY) +
                                         " fed privacy --target-epsilon 0.001 --sampling-rate 1 "
                                         "--rounds 100000",
                                     &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("cannot be reached"), std::string::npos) << out;
  out = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) + " fed privacy --sampling-rate 1 --rounds 10", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("--target-epsilon"), std::string::npos) << out;
}
