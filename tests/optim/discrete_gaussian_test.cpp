// The exact discrete Gaussian sampler against its probability mass function, and the distributed
// discrete Gaussian's RDP against the Gaussian mechanism's where they must agree.
#include "optim/discrete_gaussian.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numbers>

#include "base/error.h"
#include "optim/privacy_accountant.h"

using namespace pollen;
using optim::discrete_gaussian;

namespace {

// Frequencies of `draws` values from `draw`.
template <class Draw>
std::map<int64_t, int64_t> histogram(int64_t draws, Draw draw) {
  std::map<int64_t, int64_t> h;
  for (int64_t i = 0; i < draws; ++i) ++h[draw()];
  return h;
}

// Each value's frequency within 5 standard deviations of its probability p(x), for every x whose
// probability is at least 1e-4, and no value drawn whose probability is below 1e-12.
template <class Pmf>
void expect_frequencies(const std::map<int64_t, int64_t>& h, int64_t draws, Pmf p, int64_t reach) {
  const auto n = static_cast<double>(draws);
  for (int64_t x = -reach; x <= reach; ++x) {
    const double want = p(x);
    if (want < 1e-4) continue;
    const auto it = h.find(x);
    const double got = it == h.end() ? 0 : static_cast<double>(it->second) / n;
    EXPECT_NEAR(got, want, 5 * std::sqrt(want * (1 - want) / n)) << "x = " << x;
  }
  for (const auto& [x, count] : h) EXPECT_GT(p(x), 1e-12) << "x = " << x << " drawn " << count;
}

double discrete_gaussian_pmf(int64_t x, double variance) {
  double norm = 0;
  for (int64_t k = -2000; k <= 2000; ++k) {
    norm += std::exp(-static_cast<double>(k * k) / (2 * variance));
  }
  return std::exp(-static_cast<double>(x * x) / (2 * variance)) / norm;
}

}  // namespace

TEST(DiscreteGaussian, BernoulliExpIsTrueWithProbabilityExpMinusGamma) {
  Rng rng(1);
  const int64_t n = 200000;
  for (const auto& [num, den] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 1}, {3, 10}, {1, 1}, {5, 2}, {7, 1}, {uint64_t{1} << 40, uint64_t{1} << 39}}) {
    int64_t yes = 0;
    for (int64_t i = 0; i < n; ++i) yes += optim::bernoulli_exp(rng, num, den) ? 1 : 0;
    const double p = std::exp(-static_cast<double>(num) / static_cast<double>(den));
    const double got = static_cast<double>(yes) / static_cast<double>(n);
    EXPECT_NEAR(got, p, 5 * std::sqrt(p * (1 - p) / static_cast<double>(n)) + 1e-12)
        << num << " / " << den;
  }
  // The numerators the discrete Gaussian passes at its largest variance reach 2^124, against a
  // denominator of about 2^113 there; and gamma = 2 from 2^120 over 2^119.
  const optim::DiscreteU128 one = 1;
  int64_t yes = 0;
  for (int64_t i = 0; i < n; ++i) {
    yes += optim::bernoulli_exp(rng, one << 120, one << 119) ? 1 : 0;
    EXPECT_FALSE(optim::bernoulli_exp(rng, (one << 124) - 1, one << 113));
  }
  const double p = std::exp(-2.0);
  EXPECT_NEAR(static_cast<double>(yes) / static_cast<double>(n), p,
              5 * std::sqrt(p * (1 - p) / static_cast<double>(n)));
}

TEST(DiscreteGaussian, DiscreteLaplaceMatchesItsMassFunction) {
  Rng rng(2);
  const int64_t n = 200000;
  const uint64_t t = 3;
  const auto h = histogram(n, [&] { return optim::discrete_laplace(rng, t); });
  const double r = std::exp(-1.0 / static_cast<double>(t));
  expect_frequencies(
      h, n, [&](int64_t x) { return (1 - r) / (1 + r) * std::pow(r, std::abs(x)); }, 60);
}

TEST(DiscreteGaussian, SmallVariancesMatchTheMassFunctionNotARoundedNormal) {
  // At variance 2 the discrete Gaussian puts 0.2821 on zero, a rounded continuous normal 0.2763:
  // 400k draws tell them apart by 8 standard deviations.
  Rng rng(3);
  for (const uint64_t variance : {uint64_t{1}, uint64_t{2}, uint64_t{30}}) {
    const int64_t n = 400000;
    const auto v = static_cast<double>(variance);
    const auto h = histogram(n, [&] { return discrete_gaussian(rng, variance); });
    expect_frequencies(
        h, n, [&](int64_t x) { return discrete_gaussian_pmf(x, v); }, 100);
  }
  EXPECT_NEAR(discrete_gaussian_pmf(0, 2), 0.2821, 1e-4);
}

TEST(DiscreteGaussian, LargeVariancesHaveTheirMeanAndVariance) {
  Rng rng(4);
  for (const uint64_t variance : {uint64_t{1} << 40, optim::kMaxDiscreteVariance}) {
    const int64_t n = 100000;
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto x = static_cast<double>(discrete_gaussian(rng, variance));
      s += x;
      s2 += x * x;
    }
    const auto v = static_cast<double>(variance);
    const double mean = s / static_cast<double>(n);
    EXPECT_NEAR(mean, 0, 5 * std::sqrt(v / static_cast<double>(n)));
    // The sample variance's relative std is sqrt(2 / n), 0.45%.
    EXPECT_NEAR(s2 / static_cast<double>(n) / v, 1, 0.025);
  }
  EXPECT_THROW(discrete_gaussian(rng, 0), Error);
  EXPECT_THROW(discrete_gaussian(rng, optim::kMaxDiscreteVariance + 1), Error);
}

TEST(DiscreteGaussian, OneShareCostsWhatTheGaussianMechanismDoes) {
  // One share (or shares so wide that tau underflows): alpha l2^2 / (2 variance), the Gaussian
  // mechanism of multiplier sqrt(variance) / l2, as the sampled Gaussian's accountant computes it.
  const auto& orders = optim::rdp_orders();
  const auto one = optim::distributed_discrete_gaussian_rdp(10, 30, 9, 50, 50, 1);
  const auto wide = optim::distributed_discrete_gaussian_rdp(1e4, 1e6, 1000, 4e8, 1e8, 4);
  for (size_t k = 0; k < orders.size(); ++k) {
    EXPECT_NEAR(one[k], optim::sampled_gaussian_rdp(1, std::sqrt(50.0) / 10, orders[k]),
                1e-9 * one[k]);
    EXPECT_NEAR(wide[k], optim::sampled_gaussian_rdp(1, 2.0, orders[k]), 1e-9 * wide[k]);
  }
}

TEST(DiscreteGaussian, NarrowSharesPayForTheSumsDistanceFromADiscreteGaussian) {
  const auto& orders = optim::rdp_orders();
  const double a = 10 / std::sqrt(50.0);  // l2 over the sum's std
  const double pi2 = std::numbers::pi * std::numbers::pi;
  // Shares of variance 1/4 (the theorem's least) among up to 3 on 9 values:
  // tau = 10 * 2 * exp(-pi^2 / 4) = 1.6960, and the first bound, a^2 alpha / 2 + 9 tau, is the
  // smallest at every order.
  const double wide_tau = 20 * std::exp(-0.25 * pi2);
  EXPECT_NEAR(wide_tau, 1.6960, 1e-4);
  const auto narrow = optim::distributed_discrete_gaussian_rdp(10, 30, 9, 50, 0.25, 3);
  EXPECT_THROW(optim::distributed_discrete_gaussian_rdp(10, 30, 9, 50, 0.2, 3), Error);
  // Shares of variance 1 between 2 on a million values: tau = 10 exp(-pi^2) = 5.17e-4, tau d =
  // 517, and the second bound, (a^2 + 2 b tau + tau^2 d) alpha / 2 with b = 30 / sqrt(50), is the
  // smallest at every order (the third is (a + 1000 tau)^2 alpha / 2 = 1.87 alpha).
  const double small_tau = 10 * std::exp(-pi2);
  const auto many = optim::distributed_discrete_gaussian_rdp(10, 30, 1000000, 50, 1, 2);
  for (size_t k = 0; k < orders.size(); ++k) {
    const double alpha = orders[k];
    EXPECT_NEAR(narrow[k], alpha * a * a / 2 + 9 * wide_tau, 1e-9 * narrow[k]) << alpha;
    const double b = 3 * a;
    const double second = alpha / 2 * (a * a + 2 * b * small_tau + small_tau * small_tau * 1e6);
    EXPECT_NEAR(many[k], second, 1e-9 * many[k]) << alpha;
    const double gaussian = optim::sampled_gaussian_rdp(1, 1 / a, alpha);
    EXPECT_GT(narrow[k], gaussian);
    EXPECT_GT(many[k], gaussian);
  }
}
