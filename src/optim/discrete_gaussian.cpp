#include "optim/discrete_gaussian.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "base/error.h"
#include "optim/privacy_accountant.h"

namespace pollen::optim {

namespace {

using u128 = DiscreteU128;

// The generator's 64-bit words one bit at a time, so that a Bernoulli trial spends the two bits
// it needs on average instead of a word or two.
class RandomBits {
 public:
  explicit RandomBits(Rng& rng) : rng_(rng) {}
  bool next() {
    if (left_ == 0) {
      word_ = rng_.next_u64();
      left_ = 64;
    }
    --left_;
    return ((word_ >> left_) & 1) != 0;
  }
  Rng& rng() { return rng_; }

 private:
  Rng& rng_;
  uint64_t word_ = 0;
  int left_ = 0;
};

// The comparison of a uniform U in [0, 1), drawn bit by bit, against the binary expansion of
// p / q (p < q, q < 2^(bits of Int - 1)), decided at the first bit where the two differ (after
// two bits on average): true when U < p / q, exactly.
template <typename Int>
bool uniform_below_fraction(RandomBits& bits, Int p, Int q) {
  Int rest = p;  // p / q's expansion still to come, times q: always below q
  while (rest != 0) {
    rest <<= 1;
    const bool digit = rest >= q;
    if (digit) rest -= q;
    const bool u = bits.next();
    if (u != digit) return digit;  // U's bit 0 against p / q's 1: U is the smaller
  }
  return false;  // p / q's expansion ended: U is at least p / q (equal with probability 0)
}

// True with probability p / q (q < 2^127), in 64-bit arithmetic where q allows.
bool bernoulli(RandomBits& bits, u128 p, u128 q) {
  POLLEN_ASSERT(q >> 127 == 0);  // the expansion's doubling stays under 2^128
  if (p >= q) return true;
  if (q >> 63 == 0) {
    return uniform_below_fraction<uint64_t>(bits, static_cast<uint64_t>(p),
                                            static_cast<uint64_t>(q));
  }
  return uniform_below_fraction<u128>(bits, p, q);
}

// exp(-gamma) for gamma = num / den in [0, 1]: the parity of the first K for which a draw of
// Bernoulli(gamma / K) fails (algorithm 1).
bool bernoulli_exp_at_most_one(RandomBits& bits, u128 num, u128 den) {
  u128 k = 1;
  while (bernoulli(bits, num, den * k)) ++k;  // bernoulli asserts den * k < 2^127
  return (k & 1) == 1;
}

bool bernoulli_exp(RandomBits& bits, u128 num, u128 den) {
  // den * k below 2^127 in bernoulli_exp_at_most_one while k < 128 (k reaches K with probability
  // 1 / (K - 1)!: 128 never, in practice).
  POLLEN_ASSERT(den > 0 && num >> 126 == 0 && den >> 120 == 0);
  // exp(-gamma) = exp(-1)^floor(gamma) exp(-(gamma - floor(gamma))).
  while (num > den) {
    if (!bernoulli_exp_at_most_one(bits, 1, 1)) return false;
    num -= den;
  }
  return bernoulli_exp_at_most_one(bits, num, den);
}

int64_t discrete_laplace(RandomBits& bits, uint64_t t) {
  POLLEN_ASSERT(t >= 1 && t < (uint64_t{1} << 32));
  // Algorithm 2: X = U + t V with U uniform in [0, t) kept with probability exp(-U / t) and V
  // geometric with ratio exp(-1), then a sign (a negative zero drawn again).
  for (;;) {
    const uint64_t u = bits.rng().below(t);
    if (!bernoulli_exp(bits, u, t)) continue;
    uint64_t v = 0;
    while (bernoulli_exp(bits, 1, 1)) ++v;
    if (v > (uint64_t{1} << 30)) continue;  // probability below exp(-2^30): out of int64's range
    const uint64_t x = u + t * v;
    const bool negative = bits.next();
    if (negative && x == 0) continue;
    return negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
  }
}

uint64_t integer_sqrt(uint64_t v) {
  auto r = static_cast<uint64_t>(std::sqrt(static_cast<double>(v)));
  while (r * r > v) --r;
  while ((r + 1) * (r + 1) <= v) ++r;
  return r;
}

}  // namespace

bool bernoulli_exp(Rng& rng, u128 num, u128 den) {
  RandomBits bits(rng);
  return bernoulli_exp(bits, num, den);
}

int64_t discrete_laplace(Rng& rng, uint64_t t) {
  RandomBits bits(rng);
  return discrete_laplace(bits, t);
}

int64_t discrete_gaussian(Rng& rng, uint64_t variance) {
  POLLEN_CHECK(variance >= 1 && variance <= kMaxDiscreteVariance,
               "discrete Gaussian: the variance must be in [1, 2^56], got ", variance);
  // Algorithm 3: a discrete Laplace draw Y of scale t = floor(sigma) + 1, kept with probability
  // exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)) = exp(-(|Y| t - sigma^2)^2 / (2 sigma^2 t^2)).
  const uint64_t t = integer_sqrt(variance) + 1;
  const u128 den = u128{2} * variance * t * t;  // below 2^114
  // A draw with |Y| t past 2^62 would be kept with probability below exp(-2^124 / 2^114), the
  // numerator over the largest denominator: it is drawn again, which keeps the numerator below
  // 2^124.
  const uint64_t largest = (uint64_t{1} << 62) / t;
  RandomBits bits(rng);
  for (;;) {
    const int64_t y = discrete_laplace(bits, t);
    const auto a = static_cast<uint64_t>(y < 0 ? -y : y);
    if (a > largest) continue;
    const uint64_t at = a * t;
    const u128 diff = at >= variance ? at - variance : variance - at;
    if (bernoulli_exp(bits, diff * diff, den)) return y;
  }
}

std::vector<double> distributed_discrete_gaussian_rdp(double l2, double l1, int64_t dim,
                                                      double sum_variance, double share_variance,
                                                      int64_t most_shares) {
  // Their theorem asks for shares of std at least 1/2.
  POLLEN_CHECK(l2 >= 0 && l1 >= 0 && dim >= 1 && sum_variance > 0 && share_variance >= 0.25 &&
                   most_shares >= 1,
               "distributed discrete Gaussian: sensitivities ", l2, " and ", l1, ", ", dim,
               " values, variances ", sum_variance, " and ", share_variance, ", ", most_shares,
               " shares");
  const double pi2 = std::numbers::pi * std::numbers::pi;
  const double tau = 10.0 * static_cast<double>(most_shares - 1) * std::exp(-pi2 * share_variance);
  const double a = l2 / std::sqrt(sum_variance);
  const double b = l1 / std::sqrt(sum_variance);
  const auto d = static_cast<double>(dim);
  std::vector<double> rdp;
  for (const double alpha : rdp_orders()) {
    const double first = alpha / 2 * a * a + tau * d;
    const double second = alpha / 2 * (a * a + 2 * b * tau + tau * tau * d);
    const double third = alpha / 2 * std::pow(a + std::sqrt(d) * tau, 2);
    rdp.push_back(std::min({first, second, third}));
  }
  return rdp;
}

}  // namespace pollen::optim
