#pragma once
// Robust aggregation: how a round's client updates become one pseudo-gradient when some clients
// may be faulty or hostile. Every rule sees the updates in client-id order, so the result never
// depends on arrival order.
//
//   mean          sum_i t_i delta_i / sum_i t_i (token-weighted; the strategies' default)
//   median        coordinate-wise median (the mean of the two middle values for even n)
//   trimmed_mean  coordinate-wise: drop the k = floor(trim_fraction * n) smallest and largest
//                 values, average the rest; needs 2k < n
//   krum          the update whose summed squared distance to its n - f - 2 nearest others is
//                 smallest (Blanchard et al. 2017); needs n > 2f + 2 for f byzantine clients
//   multi_krum    the m best by that score, averaged weighted by tokens; needs n > 2f + 2 and
//                 1 <= m <= n - f
//
// norm_bound > 0 first scales every update to an L2 norm of at most norm_bound (norm bounding,
// Sun et al. 2019), whatever the rule. median, trimmed_mean, krum and multi_krum are unweighted
// in their choice (a client's token count must not buy influence), as in Flower (FedMedian,
// FedTrimmedAvg, Krum), which tests/fed/robust_test.cpp compares with.
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace pollen::fed {

using Weights = std::vector<Tensor>;  // as in fed/strategy.h, which includes this header
struct ClientUpdate;

struct RobustOptions {
  std::string aggregation = "mean";  // mean median trimmed_mean krum multi_krum
  double norm_bound = 0;             // 0: no bound
  double trim_fraction = 0.1;        // trimmed_mean: beta, the share dropped at each side
  int64_t byzantine = 0;             // krum, multi_krum: f, the byzantine clients tolerated
  int64_t multi_krum = 0;            // multi_krum: m, the updates kept; 0: n - f
};

std::vector<std::string> aggregation_names();

// Checks names and ranges, and that every round the strategy can aggregate (at least
// min_clients updates) meets the rule's precondition; throws naming the strategy.* key.
void validate(const RobustOptions& o, int64_t min_clients);

// What aggregation did to each client's update.
struct UpdateReport {
  double norm = 0;        // L2 norm as received
  bool clipped = false;   // scaled down to norm_bound (or the DP clip norm)
  bool rejected = false;  // left out whole (krum, multi_krum)
  double trimmed = -1;    // trimmed_mean: share of its coordinates trimmed; -1: not applicable
};

struct AggregationReport {
  std::map<std::string, UpdateReport> clients;
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // rule-specific figures
  int64_t clipped() const;
  int64_t rejected() const;
};

// Refuses an update with no tokens or another layout than `like`, naming the client.
void check_client_update(const Weights& like, const ClientUpdate& u);

// sum_k w_k deltas[k], in double per element, in the order given (shapes of `like`).
Weights weighted_sum(const Weights& like, const std::vector<const Weights*>& deltas,
                     const std::vector<double>& weights);

// The L2 norm of an update over all its tensors, in double.
double l2_norm(const Weights& w);
// Scales w in place to an L2 norm of at most bound; returns whether it did.
bool clip_to_norm(Weights& w, double norm, double bound);

// The round's aggregated pseudo-gradient under rule o (shapes of `like`). Refuses zero-token
// updates, wrong layouts, and rounds that do not meet the rule's precondition, with messages
// that say which. Fills *report when given.
Weights robust_aggregate(const RobustOptions& o, const Weights& like,
                         const std::vector<ClientUpdate>& updates, AggregationReport* report);

}  // namespace pollen::fed
