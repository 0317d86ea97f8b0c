#include "optim/privacy_accountant.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/error.h"

namespace pollen::optim {

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

// A real number as its sign and the log of its magnitude.
struct LogSigned {
  bool positive = true;
  double log_abs = -kInf;
};

// b - a for a, b in log space (the magnitudes' difference keeps its sign).
LogSigned log_difference(LogSigned a, LogSigned b) {
  if (a.positive != b.positive) return {b.positive, log_add(a.log_abs, b.log_abs)};
  LogSigned d;  // |b| - |a|, then the common sign
  if (b.log_abs > a.log_abs) {
    d = {true, b.log_abs + std::log1p(-std::exp(a.log_abs - b.log_abs))};
  } else if (b.log_abs < a.log_abs) {
    d = {false, a.log_abs + std::log1p(-std::exp(b.log_abs - a.log_abs))};
  }
  if (!b.positive) d.positive = !d.positive;
  return d;
}

// log |Delta^k g(0)| for k = 1 .. n + 1 (index k - 1), the forward differences of
// g(x) = exp((x - 1) x / 2 sigma^2) = exp((x - 1) eps(x)), eps the Gaussian mechanism's RDP,
// differenced in place in log space as dp_accounting does.
std::vector<double> log_forward_differences(double sigma, int64_t n) {
  std::vector<LogSigned> v(static_cast<size_t>(n + 3));
  for (size_t x = 0; x < v.size(); ++x) {
    const double d = static_cast<double>(x);
    v[x] = {true, (d - 1) * d / (2 * sigma * sigma)};
  }
  std::vector<double> out(static_cast<size_t>(n + 2));
  for (size_t k = 0; k < out.size(); ++k) {
    for (size_t j = 0; j + 1 < v.size() - k; ++j) v[j] = log_difference(v[j], v[j + 1]);
    out[k] = v[0].log_abs;
  }
  return out;
}

// log(A_alpha) of Theorem 27 (Wang, Balle and Kasiviswanathan 2019) for integer alpha >= 2 and
// 0 < q < 1: the RDP of the Gaussian mechanism on a sample without replacement, times alpha - 1.
double log_a_without_replacement(double q, double sigma, int64_t alpha) {
  POLLEN_CHECK(alpha <= 256, "privacy accountant: order ", alpha, " is past the exact bound's 256");
  const auto eps = [&](double x) { return x / (2 * sigma * sigma); };  // the Gaussian's RDP
  const auto cgf = [&](double x) { return x * (x + 1) / (2 * sigma * sigma); };
  const double a = static_cast<double>(alpha);
  const auto log_binom = [&](double i) {
    return std::lgamma(a + 1) - std::lgamma(i + 1) - std::lgamma(a - i + 1);
  };
  const std::vector<double> diffs = log_forward_differences(sigma, alpha);
  double log_a = 0;  // the bound's leading 1
  for (int64_t k = 2; k <= alpha; ++k) {
    const double i = static_cast<double>(k);
    double s;
    if (k == 2) {
      const double log_e2_minus_1 = eps(2) + std::log1p(-std::exp(-eps(2)));
      s = std::min(std::log(4.0) + log_e2_minus_1, eps(2) + std::log(2.0));
    } else {
      const double lo = diffs[static_cast<size_t>(2 * (k / 2) - 1)];
      const double hi = diffs[static_cast<size_t>(2 * ((k + 1) / 2) - 1)];
      s = std::min(std::log(4.0) + 0.5 * (lo + hi), std::log(2.0) + cgf(i - 1));
    }
    log_a = log_add(log_a, s + i * std::log(q) + log_binom(i));
  }
  return log_a;
}

double without_replacement_rdp(double q, double sigma, double alpha) {
  if (alpha == std::floor(alpha)) {
    return log_a_without_replacement(q, sigma, static_cast<int64_t>(alpha)) / (alpha - 1);
  }
  // Between integer orders, the bound's log A interpolated linearly (their Corollary 10); at
  // order 1 it is 0.
  const double lo = std::floor(alpha), hi = std::ceil(alpha), t = alpha - lo;
  const double log_a_lo =
      lo < 2 ? 0.0 : log_a_without_replacement(q, sigma, static_cast<int64_t>(lo));
  const double log_a_hi = log_a_without_replacement(q, sigma, static_cast<int64_t>(hi));
  return ((1 - t) * log_a_lo + t * log_a_hi) / (alpha - 1);
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

double sampled_gaussian_rdp(double q, double sigma, double alpha, Sampling sampling) {
  POLLEN_CHECK(q >= 0 && q <= 1, "privacy accountant: sampling rate must be in [0, 1], got ", q);
  POLLEN_CHECK(sigma >= 0, "privacy accountant: noise multiplier must be >= 0, got ", sigma);
  POLLEN_CHECK(alpha > 1, "privacy accountant: RDP orders must be > 1, got ", alpha);
  if (q == 0) return 0;
  if (sigma == 0) return kInf;
  if (q == 1) return alpha / (2 * sigma * sigma);  // the Gaussian mechanism itself
  if (sampling == Sampling::without_replacement) return without_replacement_rdp(q, sigma, alpha);
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
  // RDP 0 at every order: the outputs' distributions are equal, (0, 0)-DP (nothing released yet;
  // the conversion below would still add its slack, about 0.1 at delta 1e-5).
  if (std::all_of(rdp.begin(), rdp.end(), [](double v) { return v == 0; })) return {0, 0};
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

void PrivacyAccountant::add(double q, double sigma, int64_t steps, Sampling sampling) {
  POLLEN_CHECK(steps >= 0, "privacy accountant: steps must be >= 0, got ", steps);
  const auto& orders = rdp_orders();
  for (size_t k = 0; k < orders.size(); ++k) {
    rdp_[k] += static_cast<double>(steps) * sampled_gaussian_rdp(q, sigma, orders[k], sampling);
  }
  steps_ += steps;
}

PrivacyAccountant PrivacyAccountant::after(double q, double sigma, int64_t steps,
                                           Sampling sampling) const {
  PrivacyAccountant a = *this;
  a.add(q, sigma, steps, sampling);
  return a;
}

void PrivacyAccountant::add_release(const std::vector<double>& release_rdp) {
  POLLEN_CHECK(release_rdp.size() == rdp_.size(), "privacy accountant: a release of ",
               release_rdp.size(), " RDP values, expected ", rdp_.size());
  for (size_t k = 0; k < rdp_.size(); ++k) {
    POLLEN_CHECK(release_rdp[k] >= 0, "privacy accountant: a negative RDP value");
    rdp_[k] += release_rdp[k];
  }
  ++steps_;
}

PrivacyAccountant PrivacyAccountant::after_release(const std::vector<double>& release_rdp) const {
  PrivacyAccountant a = *this;
  a.add_release(release_rdp);
  return a;
}

void PrivacyAccountant::restore(std::vector<double> rdp, int64_t steps) {
  POLLEN_CHECK(rdp.size() == rdp_orders().size(), "privacy accountant state: ", rdp.size(),
               " RDP values, expected ", rdp_orders().size());
  POLLEN_CHECK(steps >= 0, "privacy accountant state: negative step count");
  rdp_ = std::move(rdp);
  steps_ = steps;
}

void PrivacyAccountant::restore(const nlohmann::json& rdp, int64_t steps) {
  POLLEN_CHECK(rdp.is_array(), "privacy state: 'rdp' must be a list of numbers");
  std::vector<double> values;
  for (const auto& v : rdp) {
    POLLEN_CHECK(v.is_null() || v.is_number(), "privacy state: 'rdp' holds ", v.dump(),
                 ", not a number or null (infinite)");
    values.push_back(v.is_null() ? std::numeric_limits<double>::infinity() : v.get<double>());
  }
  restore(std::move(values), steps);
}

}  // namespace pollen::optim
