#pragma once
// The discrete Gaussian N_Z(0, sigma^2), P(x) proportional to exp(-x^2 / (2 sigma^2)) on the
// integers, drawn exactly (Canonne, Kamath and Steinke 2020, "The discrete Gaussian for
// differential privacy", algorithms 1-3): every decision compares integers, or uniform random
// bits against a rational's binary expansion, so no floating-point rounding shapes the
// distribution (Mironov 2012's attack on floating-point noise has nothing to read); and the RDP
// of the distributed discrete Gaussian (Kairouz, Liu and Steinke 2021, "The distributed discrete
// Gaussian mechanism for federated learning with secure aggregation"): each of n parties adds
// N_Z(0, sigma^2) to its integer vector, and only the sum is seen.
#include <cstdint>
#include <vector>

#include "base/rng.h"

namespace pollen::optim {

// The largest variance the samplers' 128-bit arithmetic takes: sigma up to 2^28.
constexpr uint64_t kMaxDiscreteVariance = uint64_t{1} << 56;

// True with probability exp(-num / den) (0 < den < 2^120, num < 2^126).
__extension__ typedef unsigned __int128 DiscreteU128;
bool bernoulli_exp(Rng& rng, DiscreteU128 num, DiscreteU128 den);

// The discrete Laplace distribution of scale t: P(x) proportional to exp(-|x| / t), t >= 1.
int64_t discrete_laplace(Rng& rng, uint64_t t);

// One draw of N_Z(0, variance), variance in [1, kMaxDiscreteVariance] (throws otherwise).
int64_t discrete_gaussian(Rng& rng, uint64_t variance);

// What the sum of shares of N_Z(0, share_variance) costs, at each of rdp_orders(), on an integer
// vector of `dim` values whose neighbours differ by at most `l2` in L2 norm and `l1` in L1 norm
// (Kairouz, Liu and Steinke 2021, Theorem 1 and Proposition 14):
//   RDP(alpha) = min(alpha/2 a^2 + tau dim, alpha/2 (a^2 + 2 b tau + tau^2 dim),
//                    alpha/2 (a + sqrt(dim) tau)^2),
// with a = l2 / sqrt(sum_variance), b = l1 / sqrt(sum_variance) and
// tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 share_variance k / (k + 1)), the sum's distance from a
// discrete Gaussian. It bounds the sum of any n in [1, most_shares] independent shares of one
// variance sigma^2 >= share_variance (at least 1/4, as the theorem asks) with
// n sigma^2 >= sum_variance: every term grows with a, b and tau, and tau is at most
// 10 (most_shares - 1) exp(-pi^2 share_variance). One share
// (most_shares = 1) is the discrete Gaussian mechanism, alpha l2^2 / (2 variance), as the
// Gaussian's.
std::vector<double> distributed_discrete_gaussian_rdp(double l2, double l1, int64_t dim,
                                                      double sum_variance, double share_variance,
                                                      int64_t most_shares);

}  // namespace pollen::optim
