#include "fed/accountant.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/error.h"

namespace pollen::fed {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// log(exp(x) + exp(y)) and log(exp(x) - exp(y)) (x >= y) without overflow.
double log_add(double x, double y) {
  const double a = std::min(x, y), b = std::max(x, y);
  if (a == -kInf) return b;
  return std::log1p(std::exp(a - b)) + b;
}

double log_sub(double x, double y) {
  POLLEN_CHECK(x >= y, "privacy accountant: log_sub of a larger value");
  if (y == -kInf) return x;
  if (x == y) return -kInf;
  const double d = std::expm1(x - y);
  return std::isinf(d) ? x : std::log(d) + y;
}

// log(erfc(x)), with the asymptotic series where erfc underflows (as TF Privacy does).
double log_erfc(double x) {
  const double r = std::erfc(x);
  if (r > 0) return std::log(r);
  return -std::log(M_PI) / 2 - std::log(x) - x * x - 0.5 / (x * x) + 0.625 / std::pow(x, 4) -
         37.0 / 24.0 / std::pow(x, 6) + 353.0 / 64.0 / std::pow(x, 8);
}

// log A_alpha for integer alpha: A = sum_i C(alpha, i) q^i (1-q)^(alpha-i) exp((i^2 - i) / 2s^2).
double log_a_integer(double q, double sigma, int64_t alpha) {
  double log_a = -kInf;
  const double a = static_cast<double>(alpha);
  for (int64_t k = 0; k <= alpha; ++k) {
    const double i = static_cast<double>(k);
    const double log_binom = std::lgamma(a + 1) - std::lgamma(i + 1) - std::lgamma(a - i + 1);
    const double s =
        log_binom + i * std::log(q) + (a - i) * std::log1p(-q) + (i * i - i) / (2 * sigma * sigma);
    log_a = log_add(log_a, s);
  }
  return log_a;
}

// log A_alpha for fractional alpha: the two series around z0 (Mironov et al. 2019, 3.3), summed
// until both terms fall below exp(-30).
double log_a_fractional(double q, double sigma, double alpha) {
  double log_a0 = -kInf, log_a1 = -kInf;
  const double z0 = sigma * sigma * std::log(1 / q - 1) + 0.5;
  double coef = 1;  // binom(alpha, i), built up term by term
  for (int64_t k = 0;; ++k) {
    const double i = static_cast<double>(k);
    if (k > 0) coef *= (alpha - i + 1) / i;
    const double log_coef = std::log(std::abs(coef));
    const double j = alpha - i;
    const double log_t0 = log_coef + i * std::log(q) + j * std::log1p(-q);
    const double log_t1 = log_coef + j * std::log(q) + i * std::log1p(-q);
    const double log_e0 = std::log(0.5) + log_erfc((i - z0) / (M_SQRT2 * sigma));
    const double log_e1 = std::log(0.5) + log_erfc((z0 - j) / (M_SQRT2 * sigma));
    const double log_s0 = log_t0 + (i * i - i) / (2 * sigma * sigma) + log_e0;
    const double log_s1 = log_t1 + (j * j - j) / (2 * sigma * sigma) + log_e1;
    if (coef > 0) {
      log_a0 = log_add(log_a0, log_s0);
      log_a1 = log_add(log_a1, log_s1);
    } else {
      log_a0 = log_sub(log_a0, log_s0);
      log_a1 = log_sub(log_a1, log_s1);
    }
    if (std::max(log_s0, log_s1) < -30) break;
  }
  return log_add(log_a0, log_a1);
}

}  // namespace

const std::vector<double>& rdp_orders() {
  static const std::vector<double> orders = [] {
    std::vector<double> o;
    for (int x = 1; x < 100; ++x) o.push_back(1 + x / 10.0);
    for (int a = 12; a < 64; ++a) o.push_back(a);
    return o;
  }();
  return orders;
}

double sampled_gaussian_rdp(double q, double sigma, double alpha) {
  POLLEN_CHECK(q >= 0 && q <= 1, "privacy accountant: sampling rate must be in [0, 1], got ", q);
  POLLEN_CHECK(sigma >= 0, "privacy accountant: noise multiplier must be >= 0, got ", sigma);
  POLLEN_CHECK(alpha > 1, "privacy accountant: RDP orders must be > 1, got ", alpha);
  if (q == 0) return 0;
  if (sigma == 0) return kInf;
  if (q == 1) return alpha / (2 * sigma * sigma);  // the Gaussian mechanism itself
  const double log_a = alpha == std::floor(alpha)
                           ? log_a_integer(q, sigma, static_cast<int64_t>(alpha))
                           : log_a_fractional(q, sigma, alpha);
  return log_a / (alpha - 1);
}

Epsilon rdp_to_epsilon(const std::vector<double>& rdp, double delta) {
  const auto& orders = rdp_orders();
  POLLEN_CHECK(rdp.size() == orders.size(), "privacy accountant: ", rdp.size(), " RDP values for ",
               orders.size(), " orders");
  POLLEN_CHECK(delta > 0 && delta < 1, "privacy accountant: delta must be in (0, 1), got ", delta);
  Epsilon best{kInf, 0};
  for (size_t k = 0; k < orders.size(); ++k) {
    const double a = orders[k];
    const double eps = rdp[k] - (std::log(delta) + std::log(a)) / (a - 1) + std::log((a - 1) / a);
    if (std::isnan(eps)) continue;
    if (eps < best.epsilon) best = {eps, a};
  }
  return best;
}

PrivacyAccountant::PrivacyAccountant() : rdp_(rdp_orders().size(), 0.0) {}

void PrivacyAccountant::add(double q, double sigma, int64_t steps) {
  POLLEN_CHECK(steps >= 0, "privacy accountant: steps must be >= 0, got ", steps);
  const auto& orders = rdp_orders();
  for (size_t k = 0; k < orders.size(); ++k) {
    rdp_[k] += static_cast<double>(steps) * sampled_gaussian_rdp(q, sigma, orders[k]);
  }
  steps_ += steps;
}

PrivacyAccountant PrivacyAccountant::after(double q, double sigma, int64_t steps) const {
  PrivacyAccountant a = *this;
  a.add(q, sigma, steps);
  return a;
}

void PrivacyAccountant::restore(std::vector<double> rdp, int64_t steps) {
  POLLEN_CHECK(rdp.size() == rdp_orders().size(), "privacy accountant state: ", rdp.size(),
               " RDP values, expected ", rdp_orders().size());
  POLLEN_CHECK(steps >= 0, "privacy accountant state: negative step count");
  rdp_ = std::move(rdp);
  steps_ = steps;
}

}  // namespace pollen::fed
