// The RDP accountant of differential privacy (the federation's and DP-SGD's) against Opacus
// (Poisson sampling) and dp_accounting (sampling without replacement) on grids of settings, and
// at orders worked out by hand.
#include "optim/privacy_accountant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "support/peer.h"

using namespace pollen;
using namespace pollen::optim;

TEST(Accountant, FullBatchIsTheGaussianMechanism) {
  // q = 1: RDP of the Gaussian mechanism, alpha / (2 z^2), composed linearly over steps.
  PrivacyAccountant a;
  a.add(1.0, 2.0, 3);
  const auto& orders = rdp_orders();
  for (size_t k = 0; k < orders.size(); ++k) {
    EXPECT_DOUBLE_EQ(a.rdp()[k], 3 * orders[k] / 8);
  }
  EXPECT_EQ(sampled_gaussian_rdp(0.0, 1.0, 4.0), 0.0);
  EXPECT_TRUE(std::isinf(sampled_gaussian_rdp(0.5, 0.0, 4.0)));
}

TEST(Accountant, NothingReleasedIsNoEpsilonSpent) {
  // As Opacus's accountant with an empty history: (0, 0), not the conversion's slack (a fixed
  // ~0.103 at delta 1e-5 that a run reporting its spend before any release would show).
  PrivacyAccountant a;
  EXPECT_EQ(a.epsilon(1e-5).epsilon, 0.0);
  a.add(0.0, 1.0, 10);  // nobody sampled: nothing about anyone released
  EXPECT_EQ(a.epsilon(1e-5).epsilon, 0.0);
  a.add(0.01, 1.0, 1);
  EXPECT_GT(a.epsilon(1e-5).epsilon, 0.0);
}

TEST(Accountant, IntegerOrderMatchesTheBinomialSumByHand) {
  // alpha = 2: A = (1-q)^2 + 2q(1-q) + q^2 e^(1/z^2).
  const double q = 0.1, z = 1.5;
  const double a2 = (1 - q) * (1 - q) + 2 * q * (1 - q) + q * q * std::exp(1 / (z * z));
  EXPECT_NEAR(sampled_gaussian_rdp(q, z, 2.0), std::log(a2), 1e-14);
}

TEST(Accountant, SubsamplingAmplifiesAndMoreNoiseHelps) {
  PrivacyAccountant full, sampled, noisier;
  full.add(1.0, 1.0, 100);
  sampled.add(0.1, 1.0, 100);
  noisier.add(0.1, 2.0, 100);
  EXPECT_LT(sampled.epsilon(1e-5).epsilon, full.epsilon(1e-5).epsilon);
  EXPECT_LT(noisier.epsilon(1e-5).epsilon, sampled.epsilon(1e-5).epsilon);
}

TEST(AccountantVsOpacus, EpsilonAndRdpToThreeSignificantDigits) {
  const std::string missing = peer::missing("opacus");
  if (!missing.empty()) GTEST_SKIP() << missing;
  struct Setting {
    double noise, rate;
    int64_t steps;
    double delta;
  };
  std::vector<Setting> grid;
  for (double z : {0.7, 1.1, 4.0}) {
    for (double q : {0.004, 0.2, 1.0}) {
      for (int64_t steps : {1, 50, 2000}) {
        for (double delta : {1e-5, 1e-3}) grid.push_back({z, q, steps, delta});
      }
    }
  }
  nlohmann::json input;
  input["orders"] = rdp_orders();
  for (const auto& s : grid) {
    input["settings"].push_back(
        {{"noise", s.noise}, {"rate", s.rate}, {"steps", s.steps}, {"delta", s.delta}});
  }
  const auto theirs = peer::run("optim/opacus_reference.py", input, "opacus");
  ASSERT_EQ(theirs.size(), grid.size());
  for (size_t g = 0; g < grid.size(); ++g) {
    const auto& s = grid[g];
    PrivacyAccountant a;
    a.add(s.rate, s.noise, s.steps);
    const Epsilon mine = a.epsilon(s.delta);
    const double ref = theirs[g]["epsilon"].get<double>();
    const std::string where =
        cat("noise ", s.noise, " rate ", s.rate, " steps ", s.steps, " delta ", s.delta);
    // Three significant digits.
    EXPECT_NEAR(mine.epsilon, ref, 5e-4 * std::abs(ref)) << where;
    EXPECT_EQ(mine.order, theirs[g]["order"].get<double>()) << where;
    for (size_t k = 0; k < rdp_orders().size(); ++k) {
      const double r = theirs[g]["rdp"][k].get<double>();
      EXPECT_NEAR(sampled_gaussian_rdp(s.rate, s.noise, rdp_orders()[k]), r, 1e-9 + 1e-6 * r)
          << where << " order " << rdp_orders()[k];
    }
  }
}

TEST(Accountant, WithoutReplacementOrderTwoByHand) {
  // Theorem 27 at alpha = 2 keeps one term: A = 1 + q^2 min(4 (e^eps2 - 1), 2 e^eps2) with
  // eps2 = 2 / 2z^2, the Gaussian's RDP at order 2.
  const double q = 0.1, z = 1.5, eps2 = 1 / (z * z);
  const double a2 = 1 + q * q * std::min(4 * (std::exp(eps2) - 1), 2 * std::exp(eps2));
  EXPECT_NEAR(sampled_gaussian_rdp(q, z, 2.0, Sampling::without_replacement), std::log(a2), 1e-14);
  // Between integer orders log A is interpolated: at 2.5, halfway between order 2's and 3's.
  const double at3 = sampled_gaussian_rdp(q, z, 3.0, Sampling::without_replacement) * 2;
  EXPECT_NEAR(sampled_gaussian_rdp(q, z, 2.5, Sampling::without_replacement),
              (0.5 * std::log(a2) + 0.5 * at3) / 1.5, 1e-14);
  EXPECT_DOUBLE_EQ(sampled_gaussian_rdp(1.0, z, 7.0, Sampling::without_replacement),
                   7 / (2 * z * z));
}

TEST(AccountantVsDpAccounting, SamplingWithoutReplacementToSixSignificantDigits) {
  const std::string missing = peer::missing("dp_accounting");
  if (!missing.empty()) GTEST_SKIP() << missing;
  struct Setting {
    double noise;
    int64_t clients, sample, steps;
    double delta;
  };
  std::vector<Setting> grid;
  for (double z : {0.7, 1.1, 4.0}) {
    for (auto [n, m] : {std::pair<int64_t, int64_t>{1000, 4}, {20, 5}, {9, 8}}) {
      for (int64_t steps : {1, 50, 2000}) {
        for (double delta : {1e-5, 1e-3}) grid.push_back({z, n, m, steps, delta});
      }
    }
  }
  nlohmann::json input;
  input["orders"] = rdp_orders();
  for (const auto& s : grid) {
    input["settings"].push_back({{"noise", s.noise},
                                 {"clients", s.clients},
                                 {"sample", s.sample},
                                 {"steps", s.steps},
                                 {"delta", s.delta}});
  }
  const auto theirs = peer::run("optim/dp_accounting_reference.py", input, "dp_accounting");
  ASSERT_EQ(theirs.size(), grid.size());
  for (size_t g = 0; g < grid.size(); ++g) {
    const auto& s = grid[g];
    const double q = static_cast<double>(s.sample) / static_cast<double>(s.clients);
    PrivacyAccountant a;
    a.add(q, s.noise, s.steps, Sampling::without_replacement);
    const Epsilon mine = a.epsilon(s.delta);
    const double ref = theirs[g]["epsilon"].get<double>();
    const std::string where = cat("noise ", s.noise, " sample ", s.sample, " of ", s.clients,
                                  " steps ", s.steps, " delta ", s.delta);
    EXPECT_NEAR(mine.epsilon, ref, 1e-6 * std::abs(ref)) << where;
    EXPECT_EQ(mine.order, theirs[g]["order"].get<double>()) << where;
    for (size_t k = 0; k < rdp_orders().size(); ++k) {
      const double r = theirs[g]["rdp"][k].get<double>();
      EXPECT_NEAR(sampled_gaussian_rdp(q, s.noise, rdp_orders()[k], Sampling::without_replacement),
                  r, 1e-12 + 1e-9 * r)
          << where << " order " << rdp_orders()[k];
    }
  }
}
