#include "fed/privacy.h"

#include <algorithm>
#include <cmath>

#include "base/config.h"
#include "base/log.h"
#include "base/rng.h"

namespace pollen::fed {

PrivacyOptions read_privacy_options(ConfigTable& t) {
  PrivacyOptions o;
  o.enabled = true;
  o.noise_multiplier = t.require_double("noise_multiplier");
  o.clip = t.require_double("clip");
  o.adaptive_clip = t.get_bool("adaptive_clip", o.adaptive_clip);
  o.target_quantile = t.get_double("target_quantile", o.target_quantile);
  o.clip_lr = t.get_double("clip_lr", o.clip_lr);
  o.clipped_count_stddev = t.get_double("clipped_count_stddev", o.clipped_count_stddev);
  o.weighting = t.get_string("weighting", o.weighting);
  o.token_cap = t.get_int("token_cap", o.token_cap);
  o.delta = t.get_double("delta", o.delta);
  o.epsilon_budget = t.get_double("epsilon_budget", o.epsilon_budget);
  o.noise_seed = t.get_int("noise_seed", o.noise_seed);
  o.secure_noise = t.get_bool("secure_noise", o.secure_noise);
  o.sampling = t.get_string("sampling", o.sampling);
  POLLEN_CHECK(std::isfinite(o.noise_multiplier) && o.noise_multiplier >= 0,
               t.where("noise_multiplier"), ": must be 0 or more, got ", o.noise_multiplier);
  POLLEN_CHECK(std::isfinite(o.clip) && o.clip > 0, t.where("clip"), ": must be positive, got ",
               o.clip);
  POLLEN_CHECK(o.sampling == "fixed" || o.sampling == "poisson", t.where("sampling"),
               ": expected 'fixed' (a fixed-size sample without replacement) or 'poisson' (each "
               "client on its own), got '",
               o.sampling, "'");
  POLLEN_CHECK(o.target_quantile >= 0 && o.target_quantile <= 1, t.where("target_quantile"),
               ": must be in [0, 1], got ", o.target_quantile);
  POLLEN_CHECK(o.clip_lr >= 0, t.where("clip_lr"), ": must be 0 or more, got ", o.clip_lr);
  POLLEN_CHECK(o.clipped_count_stddev == -1 || o.clipped_count_stddev > 0,
               t.where("clipped_count_stddev"), ": must be positive (or -1: m / 20), got ",
               o.clipped_count_stddev);
  POLLEN_CHECK(o.weighting == "uniform" || o.weighting == "capped_tokens", t.where("weighting"),
               ": expected 'uniform' or 'capped_tokens', got '", o.weighting, "'");
  POLLEN_CHECK(o.weighting != "capped_tokens" || o.token_cap > 0, t.where("token_cap"),
               ": weighting 'capped_tokens' needs a positive token_cap");
  POLLEN_CHECK(o.delta > 0 && o.delta < 1, t.where("delta"), ": must be in (0, 1), got ", o.delta);
  POLLEN_CHECK(o.epsilon_budget >= 0, t.where("epsilon_budget"),
               ": must be 0 (no budget) or positive, got ", o.epsilon_budget);
  // Keys of a mode that is off are ignored, said so: a clip the user thinks adapts stays fixed.
  for (const char* key : {"target_quantile", "clip_lr", "clipped_count_stddev"})
    if (!o.adaptive_clip && t.has(key))
      log::warn(t.where(key), " is for the adaptive clip, which is off: ignored (set ",
                "adaptive_clip = true, or remove the key)");
  if (o.weighting != "capped_tokens" && t.has("token_cap"))
    log::warn(t.where("token_cap"), " is for weighting = \"capped_tokens\", which is off: ",
              "ignored (set it, or remove the key)");
  return o;
}

LocalDpOptions read_local_dp_options(ConfigTable& t) {
  LocalDpOptions o;
  o.enabled = true;
  o.clip = t.require_double("clip");
  o.noise_multiplier = t.require_double("noise_multiplier");
  o.delta = t.get_double("delta", o.delta);
  o.noise_seed = t.get_int("noise_seed", o.noise_seed);
  o.secure_noise = t.get_bool("secure_noise", o.secure_noise);
  POLLEN_CHECK(std::isfinite(o.clip) && o.clip > 0, t.where("clip"), ": must be positive, got ",
               o.clip);
  POLLEN_CHECK(std::isfinite(o.noise_multiplier) && o.noise_multiplier >= 0,
               t.where("noise_multiplier"), ": must be 0 or more, got ", o.noise_multiplier);
  POLLEN_CHECK(o.delta > 0 && o.delta < 1, t.where("delta"), ": must be in (0, 1), got ", o.delta);
  t.finish();
  return o;
}

CentralDp::CentralDp(PrivacyOptions options, double poisson_rate, bool distributed)
    : options_(std::move(options)), poisson_rate_(poisson_rate), distributed_(distributed) {
  optim::warn_of_repeatable_noise("privacy.noise_seed", options_.noise_seed);
  POLLEN_CHECK(options_.sampling == "fixed" || options_.poisson(),
               "privacy.sampling: expected 'fixed' or 'poisson', got '", options_.sampling, "'");
  POLLEN_CHECK(!distributed_ || !options_.poisson(),
               "privacy: with secure aggregation the clients noise their own updates, which needs "
               "sampling 'fixed'");
  POLLEN_CHECK(poisson_rate_ > 0 && poisson_rate_ <= 1,
               "privacy: the Poisson sampling rate (strategy.fraction_fit) must be in (0, 1], got ",
               poisson_rate_);
  clip_ = options_.clip;
}

double CentralDp::sampling_rate(int64_t selected, int64_t available) const {
  // Under secure aggregation the server, whom the guarantee is against, knows whom it selected.
  if (distributed_) return 1;
  return options_.poisson() ? poisson_rate_
                            : static_cast<double>(selected) / static_cast<double>(available);
}

double CentralDp::denominator(int64_t selected, int64_t available) const {
  // Under Poisson sampling the realised count would tell whether one more client was sampled;
  // the expected count does not depend on who was.
  return options_.poisson() ? poisson_rate_ * static_cast<double>(available)
                            : static_cast<double>(selected);
}

double CentralDp::count_stddev(double m) const {
  return options_.clipped_count_stddev > 0 ? options_.clipped_count_stddev : m / 20.0;
}

double CentralDp::count_sensitivity() const {
  // Centrally one client present or absent moves the centred count by 1/2; under distributed DP
  // the server sees who took part, and a real update against a zero one (whose indicator is
  // +1/2) moves it by 1.
  return distributed_ ? 1.0 : 0.5;
}

double CentralDp::count_noise_multiplier(double m) const {
  return count_stddev(m) / count_sensitivity();
}

double CentralDp::sum_noise_multiplier(double m) const {
  const double z = options_.noise_multiplier;
  if (!options_.adaptive_clip || z == 0) return z;
  return std::pow(std::pow(z, -2) - std::pow(count_noise_multiplier(m), -2), -0.5);
}

PrivacyAccountant after_central_releases(const PrivacyAccountant& accountant,
                                         const std::string& sampling, double q, double z,
                                         int64_t rounds) {
  POLLEN_CHECK(sampling == "fixed" || sampling == "poisson",
               "privacy.sampling: expected fixed or poisson, got '", sampling, "'");
  // A client's update present or absent moves the clipped sum by at most C. With every client
  // selected (q = 1) that is all there is: the Gaussian mechanism of multiplier z.
  if (sampling == "poisson" || q == 1) return accountant.after(q, z, rounds);
  // A fixed sample below everyone has two bounds, and each Rényi order takes the tighter:
  // amplification by sampling without replacement, which holds for one client's data replaced
  // by another's, a move of up to 2C (multiplier z / 2 at rate q); and, whatever the sample
  // (drawn without looking at the data), the Gaussian of multiplier z, since given the sample
  // one client's update present or absent moves the sum by C. The second keeps a small sample
  // from costing more than selecting everyone would.
  const PrivacyAccountant sampled =
      PrivacyAccountant().after(q, z / 2, rounds, Sampling::without_replacement);
  const PrivacyAccountant whole = PrivacyAccountant().after(1, z, rounds);
  std::vector<double> rdp = accountant.rdp();
  for (size_t i = 0; i < rdp.size(); ++i) rdp[i] += std::min(sampled.rdp()[i], whole.rdp()[i]);
  PrivacyAccountant out;
  out.restore(std::move(rdp), accountant.steps() + rounds);
  return out;
}

Rng CentralDp::sampling_rng(int64_t round, int64_t attempt) const {
  // A stream of its own, apart from the noise's (2 round and 2 round + 1).
  return noise_rng(options_.noise_seed, (uint64_t{1} << 62) + static_cast<uint64_t>(round) * 1000 +
                                            static_cast<uint64_t>(attempt));
}

std::vector<std::string> CentralDp::sample_clients(
    int64_t round, int64_t attempt, const std::vector<std::string>& available) const {
  POLLEN_ASSERT(options_.poisson());
  Rng rng = sampling_rng(round, attempt);
  return poisson_sample(available, poisson_rate_, rng);
}

std::string CentralDp::refuse_round(int64_t round, int64_t selected, int64_t available,
                                    const std::vector<double>* release_rdp) const {
  const double q = sampling_rate(selected, available);
  if (options_.adaptive_clip && options_.noise_multiplier > 0) {
    const double m = denominator(selected, available);
    const double sb = count_stddev(m);
    if (options_.noise_multiplier >= count_noise_multiplier(m)) {
      return cat("privacy: adaptive clipping with noise_multiplier ", options_.noise_multiplier,
                 " needs clipped_count_stddev above ",
                 options_.noise_multiplier * count_sensitivity(), " (it is ", sb, " for ", m,
                 options_.poisson() ? " expected" : "",
                 " clients); raise privacy.clipped_count_stddev or turn adaptive_clip off");
    }
  }
  if (options_.epsilon_budget > 0) {
    const Epsilon now = epsilon();
    const PrivacyAccountant after =
        release_rdp
            ? accountant_.after_release(*release_rdp)
            : after_central_releases(accountant_, options_.sampling, q, options_.noise_multiplier);
    const Epsilon next = after.epsilon(options_.delta);
    if (next.epsilon > options_.epsilon_budget) {
      return cat("privacy budget: round ", round, " (sampling rate ", q, ", noise multiplier ",
                 options_.noise_multiplier, ") would take epsilon from ", now.epsilon, " to ",
                 next.epsilon, " at delta ", options_.delta,
                 ", past privacy.epsilon_budget = ", options_.epsilon_budget,
                 "; the run stops after ", accountant_.steps(), " private rounds");
    }
  }
  return {};
}

Weights CentralDp::aggregate(int64_t round, const Weights& like,
                             const std::vector<ClientUpdate>& updates, int64_t selected,
                             int64_t available, AggregationReport* report) {
  POLLEN_CHECK(!updates.empty() || options_.poisson(), "aggregate: no client updates");
  POLLEN_CHECK(selected >= static_cast<int64_t>(updates.size()) && available >= selected,
               "privacy: ", updates.size(), " updates from ", selected, " selected of ", available,
               " clients");
  const std::string why = refuse_round(round, selected, available);
  POLLEN_CHECK(why.empty(), why);
  std::vector<const ClientUpdate*> order;
  for (const auto& u : updates) {
    check_client_update(like, u);
    order.push_back(&u);
  }
  std::sort(order.begin(), order.end(), [](const ClientUpdate* a, const ClientUpdate* b) {
    return a->client_id < b->client_id;
  });
  AggregationReport local;
  AggregationReport& r = report ? *report : local;
  // Clipped copies, weighted: sum_i w_i clip(delta_i, C) in client-id order.
  std::vector<Weights> clipped;
  clipped.reserve(order.size());
  std::vector<const Weights*> deltas;
  std::vector<double> weights;
  int64_t unclipped = 0;
  for (const ClientUpdate* u : order) {
    clipped.push_back(clone_weights(u->delta));
    UpdateReport ur;
    ur.norm = l2_norm(clipped.back());
    ur.clipped = clip_to_norm(clipped.back(), ur.norm, clip_);
    if (!ur.clipped) ++unclipped;
    r.clients[u->client_id] = ur;
    deltas.push_back(&clipped.back());
    weights.push_back(options_.weighting == "uniform"
                          ? 1.0
                          : std::min(1.0, static_cast<double>(u->tokens) /
                                              static_cast<double>(options_.token_cap)));
  }
  Weights delta = weighted_sum(like, deltas, weights);
  clipped.clear();
  // Noise on the sum, then the fixed denominator m.
  const double m = denominator(selected, available);
  const double z_sum = sum_noise_multiplier(m);
  const auto seed_stream = static_cast<uint64_t>(round) * 2;
  add_gaussian_noise(delta, z_sum * clip_, options_.noise_seed, seed_stream, options_.secure_noise);
  for (Tensor& t : delta) {
    float* p = t.data<float>();
    for (int64_t j = 0; j < t.numel(); ++j) p[j] = static_cast<float>(p[j] / m);
  }
  account_release(sampling_rate(selected, available), m, z_sum, r);
  if (options_.adaptive_clip) {
    // Each update's indicator centred to +-1/2 (as TF Privacy's quantile estimator does), so
    // that one client moves the released count by at most 1/2: the sensitivity the noise split
    // (sum_noise_multiplier) assumes.
    const double centred = static_cast<double>(unclipped) - 0.5 * static_cast<double>(order.size());
    Weights count{Tensor::from<float>({1}, {static_cast<float>(centred)})};
    add_gaussian_noise(count, count_stddev(m), options_.noise_seed, seed_stream + 1,
                       options_.secure_noise);
    adapt_clip(count[0].data<float>()[0] / m + 0.5, r);
  }
  return delta;
}

void CentralDp::adapt_clip(double noised_fraction, AggregationReport& r) {
  clip_ *= std::exp(-options_.clip_lr * (noised_fraction - options_.target_quantile));
  r.extra["noised_unclipped_fraction"] = noised_fraction;
  r.extra["next_clip"] = clip_;
}

void CentralDp::account_release(double q, double m, double z_sum, AggregationReport& r) {
  accountant_ =
      after_central_releases(accountant_, options_.sampling, q, options_.noise_multiplier);
  report_release(q, m, z_sum, r);
}

void CentralDp::report_release(double q, double m, double z_sum, AggregationReport& r) const {
  const Epsilon e = epsilon();
  r.extra["epsilon"] = e.epsilon;
  r.extra["delta"] = options_.delta;
  r.extra["rdp_order"] = e.order;
  r.extra["noise_multiplier"] = options_.noise_multiplier;
  r.extra["sum_noise_multiplier"] = z_sum;
  r.extra["sampling_rate"] = q;
  r.extra["sampling"] = options_.sampling;
  r.extra["expected_clients"] = m;  // q * available: a fixed sample's size is its expectation
  r.extra["clip"] = clip_;
  r.extra["private_rounds"] = accountant_.steps();
}

secagg::DistributedNoise CentralDp::distributed_noise(int64_t fewest_in_sum,
                                                      int64_t selected) const {
  POLLEN_ASSERT(distributed_ && fewest_in_sum >= 1 && selected >= 1);
  const double m = static_cast<double>(selected);
  const double root_k = std::sqrt(static_cast<double>(fewest_in_sum));
  secagg::DistributedNoise n;
  n.clip = clip_;
  n.stddev = sum_noise_multiplier(m) * clip_ / root_k;
  if (options_.adaptive_clip) n.count_stddev = count_stddev(m) / root_k;
  n.token_cap = options_.weighting == "capped_tokens" ? options_.token_cap : 0;
  n.seed = options_.noise_seed;
  return n;
}

void CentralDp::account_distributed(int64_t selected, int64_t available, int64_t in_sum,
                                    const secagg::DistributedNoise& noise,
                                    const std::vector<double>& release_rdp,
                                    AggregationReport* report) {
  POLLEN_CHECK(distributed_ && in_sum >= 1 && selected >= in_sum && available >= selected,
               "privacy: a distributed release of ", in_sum, " inputs from ", selected,
               " selected of ", available, " clients");
  // The shares of the clients in the sum: at least z C, more when more than the fewest came.
  const double z_sum = noise.stddev * std::sqrt(static_cast<double>(in_sum)) / noise.clip;
  accountant_.add_release(release_rdp);
  report_release(1, static_cast<double>(selected), z_sum, *report);
  report->extra["noise"] = "discrete_gaussian";
}

void CentralDp::adapt_distributed(double mean_count, AggregationReport* report) {
  POLLEN_ASSERT(distributed_ && options_.adaptive_clip);
  adapt_clip(mean_count + 0.5, *report);
}

nlohmann::json CentralDp::state() const {
  return {{"clip", clip_}, {"rdp", accountant_.rdp()}, {"steps", accountant_.steps()}};
}

void CentralDp::load_state(const nlohmann::json& s) {
  // An adapted clip goes on from where it was; a fixed one is the config's (z is relative to it,
  // so the accounting holds either way).
  if (options_.adaptive_clip) clip_ = s.at("clip").get<double>();
  accountant_.restore(s.at("rdp"), s.at("steps").get<int64_t>());
}

void CentralDp::load_accounting(const nlohmann::json& s) {
  accountant_.restore(s.at("rdp"), s.at("steps").get<int64_t>());
}

bool LocalDp::apply(Weights& delta, uint64_t round) {
  const bool clipped = clip_to_norm(delta, l2_norm(delta), options_.clip);
  add_gaussian_noise(delta, options_.noise_multiplier * options_.clip, options_.noise_seed, round,
                     options_.secure_noise);
  accountant_.add(1.0, options_.noise_multiplier);
  return clipped;
}

nlohmann::json LocalDp::state() const {
  return {{"rdp", accountant_.rdp()}, {"steps", accountant_.steps()}};
}

void LocalDp::load_state(const nlohmann::json& s) {
  accountant_.restore(s.at("rdp"), s.at("steps").get<int64_t>());
}

}  // namespace pollen::fed
