// Central DP with privacy.sampling = "poisson" (DP-FedAvg, McMahan et al. 2018): every available
// client is selected on its own with probability q = strategy.fraction_fit, the noised sum is
// divided by the expected count q * available, and every round releases and is accounted, an
// empty one included. Checked here: the sample's law (each client's frequency, varying sizes,
// the same sample for the same seed and round), the denominator by hand against "fixed", empty
// rounds, a Coordinator that never retries and resumes to the same samples and weights, a
// simulated federation's metrics, and the config's refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/error.h"
#include "base/rng.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/privacy.h"
#include "fed/run.h"
#include "optim/privacy_accountant.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

PrivacyOptions poisson_dp(double z, double clip) {
  return central_dp(z, clip, "poisson");
}

std::vector<std::string> ten_ids() {
  return {"c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9"};
}

// The noise aggregate() adds in round `round` to a sum of `n` values: N(0, std^2) from
// noise_seed 7 and the round's stream (2 * round), as float32.
std::vector<float> noise_of_round(int64_t round, double std, int64_t n) {
  Weights w{Tensor::zeros({n}, DType::f32)};
  add_gaussian_noise(w, std, 7, static_cast<uint64_t>(round) * 2);
  return {w[0].data<float>(), w[0].data<float>() + n};
}

}  // namespace

// 2000 rounds' samples of 10 clients at q = 0.3, each from the round's generator as the
// Coordinator forks it: every client is selected at rate q (within 5 binomial standard
// deviations, +-102 of 600), every pair at q^2 (independence), and the sample's size has the
// binomial's mean 3 and variance 2.1, so it varies, empty samples included.
TEST(PoissonSampling, EachClientIsSelectedOnItsOwnAtTheRate) {
  const double q = 0.3;
  const int rounds = 2000;
  const auto ids = ten_ids();
  std::map<std::string, int> count;
  std::map<std::pair<std::string, std::string>, int> both;
  std::vector<double> sizes;
  for (int r = 1; r <= rounds; ++r) {
    Rng rng = Rng(5).fork(static_cast<uint64_t>(r * 1000));
    const auto chosen = poisson_sample(ids, q, rng);
    ASSERT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
    sizes.push_back(static_cast<double>(chosen.size()));
    for (size_t i = 0; i < chosen.size(); ++i) {
      ++count[chosen[i]];
      for (size_t j = i + 1; j < chosen.size(); ++j) ++both[{chosen[i], chosen[j]}];
    }
  }
  const double n = rounds;
  for (const auto& id : ids) EXPECT_NEAR(count[id], n * q, 5 * std::sqrt(n * q * (1 - q))) << id;
  for (size_t i = 0; i < ids.size(); ++i) {
    for (size_t j = i + 1; j < ids.size(); ++j) {
      const int pair = both[{ids[i], ids[j]}];
      EXPECT_NEAR(pair, n * q * q, 5 * std::sqrt(n * q * q * (1 - q * q)))
          << ids[i] << " and " << ids[j];
    }
  }
  double mean = 0, var = 0;
  for (double s : sizes) mean += s / n;
  for (double s : sizes) var += (s - mean) * (s - mean) / (n - 1);
  EXPECT_NEAR(mean, 10 * q, 5 * std::sqrt(10 * q * (1 - q) / n));
  EXPECT_NEAR(var, 10 * q * (1 - q), 0.4);
  // 0.7^10 of the rounds, about 56, select nobody.
  EXPECT_GT(std::count(sizes.begin(), sizes.end(), 0.0), 20);
}

TEST(PoissonSampling, TheSameSeedRoundAndAttemptDrawTheSameSample) {
  const auto ids = ten_ids();
  std::set<std::vector<std::string>> across_rounds;
  for (int r = 1; r <= 20; ++r) {
    Rng a = Rng(5).fork(static_cast<uint64_t>(r * 1000)),
        b = Rng(5).fork(static_cast<uint64_t>(r * 1000));
    const auto first = poisson_sample(ids, 0.5, a);
    EXPECT_EQ(first, poisson_sample(ids, 0.5, b)) << "round " << r;
    // Arrival order of the available clients does not matter.
    std::vector<std::string> reversed(ids.rbegin(), ids.rend());
    Rng c = Rng(5).fork(static_cast<uint64_t>(r * 1000));
    EXPECT_EQ(first, poisson_sample(reversed, 0.5, c)) << "round " << r;
    across_rounds.insert(first);
  }
  EXPECT_GT(across_rounds.size(), 10u);  // and rounds draw their own
  Rng all(1);
  EXPECT_EQ(poisson_sample(ids, 1.0, all), ids);  // q = 1: everyone, as fixed sampling does
}

// The server draws its sample like its noise: from the OS's generator, which nobody can replay,
// unless noise_seed makes both repeatable (for tests).
TEST(PoissonSampling, TheServerDrawsItsSampleSecretlyUnlessANoiseSeedIsSet) {
  const auto ids = ten_ids();
  PrivacyOptions secret = poisson_dp(1.0, 1.0);
  secret.noise_seed = -1;
  const CentralDp a(secret, 0.5), b(secret, 0.5), seeded(poisson_dp(1.0, 1.0), 0.5),
      seeded_again(poisson_dp(1.0, 1.0), 0.5);
  int differ = 0;
  for (int r = 1; r <= 20; ++r) {
    differ += a.sample_clients(r, 0, ids) != b.sample_clients(r, 0, ids);
    EXPECT_EQ(seeded.sample_clients(r, 0, ids), seeded_again.sample_clients(r, 0, ids)) << r;
  }
  EXPECT_GT(differ, 10);  // equal by chance with probability 2^-10 a round
  EXPECT_NE(seeded.sample_clients(1, 0, ids), seeded.sample_clients(1, 1, ids));
}

// Two updates of six available clients at q = 0.5, noise multiplier 1 and clip 1 in round 3:
// Delta = (clip(a) + b + N(0, 1)) / m with m = q * 6 = 3 under "poisson" (not the 2 that came),
// and m = 2, the sample's size, under "fixed" (whose q is 2 / 6); each accounted by its analysis.
TEST(PoissonSampling, TheDenominatorIsTheExpectedCount) {
  const Weights like{vec({0, 0})};
  const std::vector<ClientUpdate> ups{update("a", 10, {3, 4}), update("b", 10, {0.5f, 0})};
  const std::vector<float> noise = noise_of_round(3, 1.0, 2);
  const double sum[2] = {0.6 + 0.5, 0.8};  // a = (3, 4) clipped to norm 1, b as it is

  CentralDp poisson(poisson_dp(1.0, 1.0), 0.5);
  AggregationReport pr;
  const Weights d = poisson.aggregate(3, like, ups, 2, 6, &pr);
  for (int j = 0; j < 2; ++j) EXPECT_NEAR(d[0].data<float>()[j], (sum[j] + noise[j]) / 3, 1e-6);
  EXPECT_EQ(pr.extra["sampling"], "poisson");
  EXPECT_DOUBLE_EQ(pr.extra["expected_clients"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(pr.extra["sampling_rate"].get<double>(), 0.5);
  // Accounted as Poisson sampling: multiplier z.
  EXPECT_DOUBLE_EQ(pr.extra["epsilon"].get<double>(),
                   PrivacyAccountant().after(0.5, 1.0).epsilon(1e-5).epsilon);

  PrivacyOptions fixed_options = poisson_dp(1.0, 1.0);
  fixed_options.sampling = "fixed";
  CentralDp fixed(fixed_options);
  AggregationReport fr;
  const Weights f = fixed.aggregate(3, like, ups, 2, 6, &fr);
  for (int j = 0; j < 2; ++j) EXPECT_NEAR(f[0].data<float>()[j], (sum[j] + noise[j]) / 2, 1e-6);
  EXPECT_EQ(fr.extra["sampling"], "fixed");
  EXPECT_DOUBLE_EQ(fr.extra["expected_clients"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(fr.extra["sampling_rate"].get<double>(), 2.0 / 6);
  // Accounted by the tighter, order by order, of sampling without replacement (one client
  // replaced: multiplier z / 2 at rate 1/3) and the Gaussian of multiplier z that holds given
  // the sample; at z = 1 the Gaussian is tighter at every order.
  EXPECT_DOUBLE_EQ(fr.extra["epsilon"].get<double>(),
                   PrivacyAccountant().after(1.0, 1.0).epsilon(1e-5).epsilon);

  // The expected count need not be whole: q = 0.3 of 5 clients, m = 1.5.
  CentralDp quiet(poisson_dp(0.0, 1.0), 0.3);
  const Weights one = quiet.aggregate(1, like, {update("b", 10, {0.5f, 0})}, 1, 5, nullptr);
  EXPECT_NEAR(one[0].data<float>()[0], 0.5 / 1.5, 1e-7);
}

// Adaptive clipping's default count noise sigma_b = m / 20 takes the expected count too: 40 of
// 80 clients at q = 0.5 give sigma_b = 2 and z_Delta = (1 - 4^-2)^(-1/2) at z = 1, whatever the
// sample's size (37 here, which would give sigma_b = 1.85).
TEST(PoissonSampling, AdaptiveClippingsCountNoiseUsesTheExpectedCount) {
  PrivacyOptions o = poisson_dp(1.0, 1.0);
  o.adaptive_clip = true;
  CentralDp c(o, 0.5);
  AggregationReport report;
  c.aggregate(1, {vec({0})}, {update("a", 1, {1})}, 37, 80, &report);
  EXPECT_NEAR(report.extra["sum_noise_multiplier"].get<double>(), 1 / std::sqrt(1 - 1.0 / 16),
              1e-12);
  // 10 of 30 selected at q = 0.5: m = 15, 2 sigma_b = 1.5, so z = 2 is refused, naming m.
  PrivacyOptions loud = o;
  loud.noise_multiplier = 2;
  const std::string why = CentralDp(loud, 0.5).refuse_round(1, 10, 30);
  EXPECT_NE(why.find("for 15 expected clients"), std::string::npos) << why;
}

// A round that sampled nobody (or whose clients all failed) releases noise / m and is accounted
// at rate q; "fixed" never aggregates an empty round.
TEST(PoissonSampling, AnEmptySampleStillReleasesAndIsAccounted) {
  const Weights like{vec({0, 0, 0})};
  CentralDp c(poisson_dp(1.0, 2.0), 0.25);
  PrivacyAccountant expected;
  double last_epsilon = 0;
  for (int64_t r = 1; r <= 2; ++r) {
    AggregationReport report;
    const Weights d = c.aggregate(r, like, {}, 0, 8, &report);
    const std::vector<float> noise = noise_of_round(r, 1.0 * 2.0, 3);
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(d[0].data<float>()[j], noise[j] / 2.0, 1e-6);
    EXPECT_TRUE(report.clients.empty());
    EXPECT_EQ(report.extra["private_rounds"].get<int64_t>(), r);
    expected.add(0.25, 1.0);
    const double eps = report.extra["epsilon"].get<double>();
    EXPECT_DOUBLE_EQ(eps, expected.epsilon(1e-5).epsilon);
    EXPECT_GT(eps, last_epsilon);
    last_epsilon = eps;
  }
  PrivacyOptions fixed_options = poisson_dp(1.0, 2.0);
  fixed_options.sampling = "fixed";
  CentralDp fixed(fixed_options);
  EXPECT_THROW(fixed.aggregate(1, like, {}, 2, 8, nullptr), Error);
}

namespace {

// A server of the tiny model under Poisson-sampled central DP at q = 0.3 over ten clients that
// joined by hand and never push: every selected client drops out.
ServerConfig poisson_server(const fs::path& dir, int64_t rounds) {
  ServerConfig c = sim_config(dir, {}, "fedavg", rounds, 1).server;
  c.strategy.fraction_fit = 0.3;
  c.strategy.min_clients = 10;  // only gates the start: samples are far smaller
  c.privacy = poisson_dp(1.0, 0.1);
  return c;
}

void join_ten(Coordinator& server) {
  for (const auto& id : ten_ids()) ASSERT_TRUE(server.join(tiny_join(id), "").accepted()) << id;
}

// Runs rounds until the server stops; each round's selected clients.
std::vector<std::vector<std::string>> run_rounds(Coordinator& server) {
  std::vector<std::vector<std::string>> samples;
  while (server.begin_round()) {
    const RoundSummary s = server.end_round();
    EXPECT_TRUE(s.aggregated) << "round " << s.round;
    EXPECT_EQ(s.dropped, s.selected);
    samples.push_back(s.selected);
  }
  return samples;
}

}  // namespace

// Rounds whose every selected client fails, with fewer than min_clients selected, are aggregated
// (noise only) and accounted, never retried; a server stopped after round 2 and resumed draws
// the same samples and ends with the same weights, bit for bit, as one that ran through.
TEST(PoissonSampling, TheCoordinatorReleasesEveryRoundAndResumesToTheSameSamples) {
  Quiet quiet;
  const auto dir = temp_dir("poisson_coordinator");
  std::vector<std::vector<std::string>> through, resumed;
  Weights through_weights;
  {
    Coordinator server(poisson_server(dir / "through", 4), false);
    join_ten(server);
    through = run_rounds(server);
    through_weights = server.global_weights();
    EXPECT_EQ(server.stopped_reason(), "");
  }
  ASSERT_EQ(through.size(), 4u);
  std::set<size_t> sizes;
  for (const auto& s : through) sizes.insert(s.size());
  EXPECT_GT(sizes.size(), 1u) << "the sample's size should vary";
  {
    Coordinator first(poisson_server(dir / "stopped", 2), false);
    join_ten(first);
    resumed = run_rounds(first);
  }
  {
    Coordinator second(poisson_server(dir / "stopped", 4), true);
    join_ten(second);
    const auto rest = run_rounds(second);
    resumed.insert(resumed.end(), rest.begin(), rest.end());
    EXPECT_TRUE(bitwise_equal(second.global_weights(), through_weights));
  }
  EXPECT_EQ(resumed, through);
  const auto metrics = read_jsonl(dir / "through/server/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  PrivacyAccountant a;
  for (size_t i = 0; i < metrics.size(); ++i) {
    a.add(0.3, 1.0);
    const auto& m = metrics[i];
    EXPECT_EQ(m["status"], "aggregated");
    EXPECT_EQ(m["selected"], through[i].size());
    EXPECT_FALSE(m.contains("train_loss"));  // no client trained
    EXPECT_EQ(m["privacy"]["sampling"], "poisson");
    EXPECT_DOUBLE_EQ(m["privacy"]["expected_clients"].get<double>(), 3.0);
    EXPECT_EQ(m["privacy"]["private_rounds"], static_cast<int64_t>(i + 1));
    EXPECT_DOUBLE_EQ(m["privacy"]["epsilon"].get<double>(), a.epsilon(1e-5).epsilon);
  }
  // Under "fixed" the same rounds would have too few updates and be retried.
  ServerConfig fixed = poisson_server(dir / "fixed", 1);
  fixed.privacy.sampling = "fixed";
  fixed.max_round_retries = 0;
  Coordinator server(fixed, false);
  join_ten(server);
  ASSERT_TRUE(server.begin_round());
  EXPECT_FALSE(server.end_round().aggregated);
  fs::remove_all(dir);
}

// Four silos for three rounds at q = 0.5 with min_clients 4: the run ends, every round is
// aggregated and accounted at rate 0.5 with 2 clients expected, and some round trains fewer
// clients than min_clients.
TEST(PoissonSampling, ASimulatedFederationRunsToTheEndAndSaysHowItSampled) {
  Quiet quiet;
  const auto dir = temp_dir("poisson_sim");
  std::vector<fs::path> silos;
  for (int i = 0; i < 4; ++i) silos.push_back(make_silo(dir / cat("silo", i), 1 + 2 * i, 60, 10));
  SimConfig cfg = sim_config(dir, silos, "fedavg", 3, 2);
  cfg.server.eval_every = 0;
  cfg.server.strategy.fraction_fit = 0.5;
  cfg.server.strategy.min_clients = 4;
  cfg.server.privacy = poisson_dp(1.0, 0.05);
  const SimulationResult r = run_simulation(cfg, false);
  EXPECT_EQ(r.rounds, 3);
  EXPECT_EQ(r.stopped, "");
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 3u);
  PrivacyAccountant a;
  int64_t fewest = 4;
  for (const auto& m : metrics) {
    a.add(0.5, 1.0);
    EXPECT_EQ(m["status"], "aggregated");
    EXPECT_EQ(m["aggregation"], "dp_mean");
    EXPECT_EQ(m["privacy"]["sampling"], "poisson");
    EXPECT_DOUBLE_EQ(m["privacy"]["expected_clients"].get<double>(), 2.0);
    EXPECT_DOUBLE_EQ(m["privacy"]["sampling_rate"].get<double>(), 0.5);
    EXPECT_DOUBLE_EQ(m["privacy"]["epsilon"].get<double>(), a.epsilon(1e-5).epsilon);
    fewest = std::min(fewest, m["selected"].get<int64_t>());
  }
  EXPECT_LT(fewest, 4);
  fs::remove_all(dir);
}

TEST(PoissonSampling, ConfigRefusalsNameTheKey) {
  const auto dir = temp_dir("poisson_config");
  const std::string base = "[server]\ndir = 'x'\n" + kTinyModelToml;
  const std::string privacy = "[privacy]\nnoise_multiplier = 1.0\nclip = 1.0\n";
  EXPECT_EQ(server_config_error(dir / "ok.toml", base + privacy + "sampling = 'poisson'\n"), "");
  EXPECT_TRUE(load_server_config(dir / "ok.toml").privacy.poisson());
  EXPECT_EQ(load_server_config(dir / "ok.toml").strategy.fraction_fit, 1.0);
  const std::string bad =
      server_config_error(dir / "bad.toml", base + privacy + "sampling = 'uniform'\n");
  for (const char* part : {"privacy.sampling", "'fixed'", "'poisson'", "'uniform'"})
    EXPECT_NE(bad.find(part), std::string::npos) << part << " in: " << bad;
  // What central DP refuses, Poisson-sampled central DP refuses too.
  const std::string poisson = privacy + "sampling = 'poisson'\n";
  EXPECT_NE(server_config_error(dir / "secagg.toml",
                                base + poisson + "[secure_aggregation]\nenabled = true\n")
                .find("secure aggregation"),
            std::string::npos);
  EXPECT_NE(server_config_error(dir / "median.toml",
                                base + poisson + "[strategy]\naggregation = 'median'\n")
                .find("aggregation = 'mean'"),
            std::string::npos);
  // Without [privacy] (a config made in code) nothing would account for it.
  ServerConfig no_dp = sim_config(dir, {}, "fedavg", 1, 1).server;
  no_dp.privacy.sampling = "poisson";
  try {
    Coordinator c(no_dp, false);
    ADD_FAILURE() << "poisson sampling without [privacy] was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("privacy.sampling"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
