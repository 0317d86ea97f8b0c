#pragma once
// Differential privacy of the federation, at the level of whole clients (a silo's entire data is
// the unit protected).
//
// Central DP (`[privacy]` of the server): the server clips every update to an L2 norm C, sums
// them in client-id order with weight w_i <= 1, adds Gaussian noise N(0, (z C)^2 I) to the sum
// and divides by the number m of clients selected for the round (a fixed denominator that does
// not depend on the data, as DP-FedAvg does: McMahan et al. 2018):
//
//   Delta = (sum_i w_i clip(delta_i, C) + N(0, (z_Delta C)^2 I)) / m
//
// w_i = 1 (uniform) or min(1, t_i / token_cap) (capped tokens): unbounded token weights would
// let one client's influence, and so the sensitivity, grow without limit. With adaptive clipping
// (Andrew et al. 2021) C follows the target quantile gamma of the update norms:
//   b = (sum_i ([|delta_i| <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2,
//   C <- C exp(-eta_C (b - gamma)),
// each indicator centred so that one client moves the count by at most 1/2; the sum's noise is
// then z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), so that the two releases together cost what one
// Gaussian mechanism of multiplier z does. The accountant (optim/privacy_accountant.h) composes
// one sampled Gaussian release of multiplier z per aggregated round; a round that would take
// epsilon past the budget is not started.
//
// Sampling (privacy.sampling), each accounted by an analysis that holds for it; the guarantee is
// about one client's update being there or not (which clients are available is not secret), a
// change that moves the clipped sum by at most C:
//   "poisson": every available client selected independently with probability q
//     (strategy.fraction_fit), the denominator the expected count m = q * available, DP-FedAvg's
//     qW, so that no client's presence moves it: the Poisson-sampled Gaussian of multiplier z. A
//     sample may be empty, or every selected client may fail: the round still releases
//     noise / m and is accounted.
//   "fixed" (the default): a uniformly random sample of m = max(ceil(q n), min_clients) of the
//     n available clients without replacement, the denominator m. Every client selected
//     (m = n): the Gaussian of multiplier z. Otherwise, at each Rényi order, the tighter of two
//     sound bounds: amplification by sampling without replacement, which is proven for one
//     client's data replaced by another's (a move of up to 2C), so the Gaussian of multiplier
//     z / 2 on a sample without replacement at rate m / n; and the Gaussian of multiplier z,
//     which holds given any sample. So a sample below everyone never costs more than selecting
//     everyone would.
//
// Distributed DP (`[privacy]` with `[secure_aggregation]`): the server never sees an update, so
// the clients clip and noise: each selected client clips its update to C, scales it by w_i,
// quantises it and adds the discrete Gaussian of variance (z C)^2 / k (in quantisation steps,
// rounded up) before masking, where k, the Shamir threshold, is the fewest clients
// whose inputs any sum the server can unmask holds (a survivor's self mask needs the threshold's
// revealed shares, and revealing clients sent an input). The unmasked sum's noise then has
// variance at least (z C)^2, and the server divides it by m, the clients selected. The server
// knows whom it selected, so no amplification by sampling is claimed against it: each round is
// accounted as the distributed discrete Gaussian the clients add (fed/secagg/private_quantize.h),
// which costs more than the Gaussian mechanism of multiplier z (q = 1) by the rounding's growth of
// the update's norm (under a part in a million for clips near 1 at the default step); sampling
// must be "fixed". With adaptive clipping each client also masks its centred indicator with a share
// of variance sigma_b^2 / k of the count's noise, and the update's share is z_Delta C / sqrt(k),
// where z_Delta = (z^-2 - sigma_b^-2)^(-1/2): a real update against a zero one moves the count by
// 1, not 1/2 (the server sees who took part), so this needs z < sigma_b.
//
// Local DP (`[local_dp]` of a client): the client clips its own update to C and adds
// N(0, (z C)^2 I) before it leaves the silo, trusting nobody; it logs its own epsilon (one
// Gaussian release per round it takes part in, no sampling).
//
// The noise comes from Philox keyed by 64 bits of the operating system's CSPRNG (OpenSSL
// RAND_bytes) for every release, unless noise_seed is set: then it is repeatable, for tests,
// and offers no privacy to anyone who knows the seed. Central and local DP's noise is float32;
// secure_noise makes each value the sum of four draws over 2, as DP-SGD's (optim/dp_sgd.h),
// against the attacks that read a floating-point normal draw's input from its low bits.
// Distributed DP's noise is discrete (fed/secagg/private_quantize.h), so secure_noise does not
// apply to it.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/rng.h"
#include "fed/robust.h"
#include "fed/secagg/options.h"
#include "fed/strategy.h"
#include "optim/dp_sgd.h"
#include "optim/privacy_accountant.h"

namespace pollen {
class ConfigTable;
}

namespace pollen::fed {

using optim::add_gaussian_noise;
using optim::Epsilon;
using optim::noise_rng;  // the noise's generator
using optim::PrivacyAccountant;
using optim::Sampling;

struct PrivacyOptions {
  bool enabled = false;         // a [privacy] table was given
  double noise_multiplier = 0;  // z
  double clip = 0;              // C, the initial C when adaptive
  bool adaptive_clip = false;
  double target_quantile = 0.5;       // gamma
  double clip_lr = 0.2;               // eta_C
  double clipped_count_stddev = -1;   // sigma_b; -1: m / 20 (Andrew et al.)
  std::string weighting = "uniform";  // uniform | capped_tokens
  int64_t token_cap = 0;              // capped_tokens: tokens that give the full weight 1
  double delta = 1e-5;
  double epsilon_budget = 0;       // 0: no budget
  int64_t noise_seed = -1;         // -1: the OS's CSPRNG
  bool secure_noise = false;       // each noise value four draws over 2 (optim::add_gaussian_noise)
  std::string sampling = "fixed";  // fixed | poisson: how each round's clients are drawn

  bool poisson() const { return sampling == "poisson"; }
};

// Reads the [privacy] table (docs/federated.md).
PrivacyOptions read_privacy_options(ConfigTable& table);

struct LocalDpOptions {
  bool enabled = false;  // a [local_dp] table was given
  double clip = 0;
  double noise_multiplier = 0;
  double delta = 1e-5;
  int64_t noise_seed = -1;
  bool secure_noise = false;  // as PrivacyOptions::secure_noise
};

LocalDpOptions read_local_dp_options(ConfigTable& table);

// `accountant` after `rounds` more central-DP releases of noise multiplier z at sampling rate q,
// by the analysis of privacy.sampling `sampling` (above).
PrivacyAccountant after_central_releases(const PrivacyAccountant& accountant,
                                         const std::string& sampling, double q, double z,
                                         int64_t rounds = 1);

// The server's central DP: clipping, noise, the clip norm's adaptation and the accountant.
class CentralDp {
 public:
  // `poisson_rate`: under sampling "poisson", q, the probability each available client is
  // selected with (strategy.fraction_fit); "fixed" takes q from each round's sample instead.
  // `distributed`: the clients noise under secure aggregation (above), every round at q = 1.
  explicit CentralDp(PrivacyOptions options, double poisson_rate = 1, bool distributed = false);

  // Before round `round` with `selected` of `available` clients: empty when it may start, else
  // why not (the budget would be passed, or adaptive clipping cannot afford its count noise).
  // `release_rdp`: under distributed DP, what the round's release costs at each RDP order
  // (secagg::release_rdp), charged instead of the Gaussian of multiplier z.
  std::string refuse_round(int64_t round, int64_t selected, int64_t available,
                           const std::vector<double>* release_rdp = nullptr) const;

  // The generator of attempt `attempt` of round `round`'s sample, drawn like the noise (from the
  // OS's CSPRNG, so that nobody can draw the sample again and amplification by sampling holds;
  // repeatable with noise_seed, for tests). Under "fixed" the strategy's draw takes it.
  Rng sampling_rng(int64_t round, int64_t attempt) const;
  // Under sampling "poisson": the sample from `available`, each client at rate q, drawn from
  // sampling_rng(round, attempt).
  std::vector<std::string> sample_clients(int64_t round, int64_t attempt,
                                          const std::vector<std::string>& available) const;

  // The round's noised mean pseudo-gradient; accounts for the release and adapts C. The fixed
  // denominator m is `selected` ("fixed") or q * `available` ("poisson"); under "poisson"
  // `updates` may be empty (the release is then noise / m). Fills report->clients (norm,
  // clipped) and report->extra.
  Weights aggregate(int64_t round, const Weights& like, const std::vector<ClientUpdate>& updates,
                    int64_t selected, int64_t available, AggregationReport* report);

  // Distributed DP: what each client adds when any unmasked sum holds at least `fewest_in_sum`
  // clients' inputs, of `selected` (m): the update's share of z_Delta C (z C with a fixed clip)
  // and with adaptive clipping the count's share of sigma_b.
  secagg::DistributedNoise distributed_noise(int64_t fewest_in_sum, int64_t selected) const;
  // Distributed DP: accounts for a round whose sum of `in_sum` clients' inputs, each noised by
  // `noise`, the server may unmask, at the cost `release_rdp` (secagg::release_rdp: the discrete
  // Gaussian's, above the Gaussian of multiplier z), and fills report->extra. Never
  // refuses: refuse_round decided before the round whether it may start.
  void account_distributed(int64_t selected, int64_t available, int64_t in_sum,
                           const secagg::DistributedNoise& noise,
                           const std::vector<double>& release_rdp, AggregationReport* report);
  // Distributed DP with adaptive clipping, after account_distributed: C follows the unmasked
  // count's mean, sum_i ([|delta_i| <= C] - 1/2) + noise, over m.
  void adapt_distributed(double mean_count, AggregationReport* report);

  Epsilon epsilon() const { return accountant_.epsilon(options_.delta); }
  int64_t private_rounds() const { return accountant_.steps(); }
  double clip() const { return clip_; }
  const PrivacyOptions& options() const { return options_; }

  nlohmann::json state() const;  // clip norm and accountant, for server checkpoints
  void load_state(const nlohmann::json& state);
  // The accountant alone of a state (the clip stays): releases made since the state this one
  // was loaded from, counted though their rounds run again.
  void load_accounting(const nlohmann::json& state);

 private:
  // The round's sampling rate q and fixed denominator m (a number of clients, fractional
  // under "poisson").
  double sampling_rate(int64_t selected, int64_t available) const;
  double denominator(int64_t selected, int64_t available) const;
  double count_stddev(double m) const;
  // How far one client moves the centred count: 1/2 centrally, 1 under distributed DP.
  double count_sensitivity() const;
  // sigma_b over the count's sensitivity: 2 sigma_b centrally, sigma_b under distributed DP.
  double count_noise_multiplier(double m) const;
  double sum_noise_multiplier(double m) const;
  // Accounts for one release of the Gaussian mechanism and reports it.
  void account_release(double q, double m, double z_sum, AggregationReport& r);
  // Writes the round's privacy figures, the clip it used among them, into r.extra.
  void report_release(double q, double m, double z_sum, AggregationReport& r) const;
  // C <- C exp(-eta_C (b - gamma)) for the released fraction b of unclipped updates.
  void adapt_clip(double noised_fraction, AggregationReport& r);

  PrivacyOptions options_;
  double poisson_rate_;
  bool distributed_;
  double clip_;
  PrivacyAccountant accountant_;
};

// A client's local DP.
class LocalDp {
 public:
  explicit LocalDp(LocalDpOptions options) : options_(std::move(options)) {
    optim::warn_of_repeatable_noise("local_dp.noise_seed", options_.noise_seed);
  }
  // Clips and noises the update in place, accounts for it; returns whether it was clipped.
  bool apply(Weights& delta, uint64_t round);
  Epsilon epsilon() const { return accountant_.epsilon(options_.delta); }
  int64_t releases() const { return accountant_.steps(); }

  nlohmann::json state() const;  // the accountant, for the client's saved state
  void load_state(const nlohmann::json& state);

 private:
  LocalDpOptions options_;
  PrivacyAccountant accountant_;
};

}  // namespace pollen::fed
