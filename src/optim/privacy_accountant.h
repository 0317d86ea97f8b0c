#pragma once
// The privacy accountant: Rényi differential privacy (RDP) of the sampled Gaussian mechanism,
// composed over releases and converted to (epsilon, delta). The federation's client-level DP
// (fed/privacy.h) and DP-SGD's record-level DP (optim/dp_sgd.h) both account with it.
//
// One release is sum_i clip(g_i) + N(0, (z C)^2 I) over a sample of the units protected (clients,
// or training sequences) in which each is present with probability q; its RDP at order alpha is
// log(A_alpha) / (alpha - 1) (Mironov, Talwar and Zhang 2019, "Rényi differential privacy of the
// sampled Gaussian mechanism"), with A_alpha summed in log space: by the binomial expansion for
// integer alpha, by the two convergent series of their section 3.3 for fractional alpha. RDP
// composes by adding over releases; epsilon at delta is the best over the tracked orders of
// rdp - (log delta + log alpha) / (alpha - 1) + log((alpha - 1) / alpha) (Balle et al. 2020).
// Orders and formulas are Opacus's (opacus.accountants.analysis.rdp, 1.4), which
// tests/optim/privacy_accountant_test.cpp compares with on a grid of settings.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

namespace pollen::optim {

// The orders at which RDP is tracked: 1.1, 1.2, ..., 10.9 and 12, 13, ..., 63 (Opacus's).
const std::vector<double>& rdp_orders();

// How a release's clients were drawn.
enum class Sampling {
  poisson,              // each independently with probability q (add or remove one)
  without_replacement,  // q n of n, uniformly (replace one)
};

// RDP at order alpha (> 1) of one release of the Gaussian mechanism with noise multiplier sigma
// (noise std / sensitivity under the sampling's neighbouring relation) on a sample of rate q in
// [0, 1].
double sampled_gaussian_rdp(double q, double sigma, double alpha,
                            Sampling sampling = Sampling::poisson);

struct Epsilon {
  double epsilon = 0;
  double order = 0;  // the order that gave it
};

// (epsilon, delta) from RDP values at rdp_orders(); infinite when every order is.
Epsilon rdp_to_epsilon(const std::vector<double>& rdp, double delta);

class PrivacyAccountant {
 public:
  PrivacyAccountant();
  // Composes `steps` releases with sampling rate q and noise multiplier sigma.
  void add(double q, double sigma, int64_t steps = 1, Sampling sampling = Sampling::poisson);
  // What add(q, sigma, steps, sampling) would leave, without taking it.
  PrivacyAccountant after(double q, double sigma, int64_t steps = 1,
                          Sampling sampling = Sampling::poisson) const;
  // Composes one release whose RDP at each of rdp_orders() is `release_rdp` (a mechanism other
  // than the sampled Gaussian: optim/discrete_gaussian.h's).
  void add_release(const std::vector<double>& release_rdp);
  PrivacyAccountant after_release(const std::vector<double>& release_rdp) const;
  Epsilon epsilon(double delta) const { return rdp_to_epsilon(rdp_, delta); }
  int64_t steps() const { return steps_; }

  // For checkpoints: the RDP per order and the steps composed.
  const std::vector<double>& rdp() const { return rdp_; }
  void restore(std::vector<double> rdp, int64_t steps);
  // rdp() as a checkpoint's JSON holds it: JSON has no infinity, so an order whose RDP is +inf
  // (a release without noise) was written as null.
  void restore(const nlohmann::json& rdp, int64_t steps);

 private:
  std::vector<double> rdp_;
  int64_t steps_ = 0;
};

}  // namespace pollen::optim
