#include "train/preference_loss.h"

#include <cmath>

#include "base/error.h"

namespace pollen::train {
namespace {

// log sigmoid(x) without overflow for large |x|.
double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

double sigmoid(double x) {
  return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x));
}

}  // namespace

PreferenceLossKind preference_loss_named(const std::string& name, const std::string& where) {
  if (name == "sigmoid") return PreferenceLossKind::sigmoid;
  if (name == "ipo") return PreferenceLossKind::ipo;
  fail(where, ": expected \"sigmoid\" or \"ipo\", got \"", name, "\"");
}

void PreferenceStats::add(const PreferenceStats& other) {
  pairs += other.pairs;
  loss += other.loss;
  chosen_rewards += other.chosen_rewards;
  rejected_rewards += other.rejected_rewards;
  correct += other.correct;
  chosen_logps += other.chosen_logps;
  rejected_logps += other.rejected_logps;
}

void PreferenceStats::sum_over(dist::Communicator& comm, int64_t& tokens) {
  double sums[] = {static_cast<double>(pairs),
                   loss,
                   chosen_rewards,
                   rejected_rewards,
                   correct,
                   chosen_logps,
                   rejected_logps,
                   static_cast<double>(tokens)};
  comm.all_reduce_sum(sums, "the step's preference metrics");
  pairs = static_cast<int64_t>(sums[0]);
  loss = sums[1];
  chosen_rewards = sums[2];
  rejected_rewards = sums[3];
  correct = sums[4];
  chosen_logps = sums[5];
  rejected_logps = sums[6];
  tokens = static_cast<int64_t>(sums[7]);
}

std::vector<std::pair<std::string, double>> PreferenceStats::means() const {
  const double n = pairs > 0 ? static_cast<double>(pairs) : 1.0;
  return {{"rewards/chosen", chosen_rewards / n},
          {"rewards/rejected", rejected_rewards / n},
          {"rewards/margins", (chosen_rewards - rejected_rewards) / n},
          {"rewards/accuracies", correct / n},
          {"logps/chosen", chosen_logps / n},
          {"logps/rejected", rejected_logps / n}};
}

ag::Var preference_loss(const ag::Var& logps, const std::vector<double>& reference,
                        const std::vector<int64_t>& lengths, const PreferenceLossOptions& options,
                        double scale, PreferenceStats* stats) {
  const std::vector<double> policy = logps.value().to_doubles();
  const size_t pairs = policy.size() / 2;
  POLLEN_CHECK(policy.size() % 2 == 0 && reference.size() == policy.size() &&
                   lengths.size() == policy.size(),
               "preference_loss: ", policy.size(), " log-probabilities, ", reference.size(),
               " references and ", lengths.size(), " lengths; expected 2P of each");
  const double beta = options.beta, eps = options.label_smoothing;
  const bool ipo = options.kind == PreferenceLossKind::ipo;

  // Forward in double, with d loss / d logps (2P) beside it.
  double loss = 0;
  std::vector<double> dlogps(policy.size());
  PreferenceStats s;
  for (size_t i = 0; i < pairs; ++i) {
    const size_t c = i, r = pairs + i;
    // IPO compares mean log-probabilities per completion token; the sigmoid loss, sums.
    const double nc = ipo ? static_cast<double>(std::max<int64_t>(lengths[c], 1)) : 1.0;
    const double nr = ipo ? static_cast<double>(std::max<int64_t>(lengths[r], 1)) : 1.0;
    const double chosen_ratio = (policy[c] - reference[c]) / nc;
    const double rejected_ratio = (policy[r] - reference[r]) / nr;
    const double h = chosen_ratio - rejected_ratio;
    double pair_loss = 0, dh = 0;  // dh: d pair_loss / dh
    if (ipo) {
      const double d = h - 1 / (2 * beta);
      pair_loss = d * d;
      dh = 2 * d;
    } else {
      const double z = beta * h;
      pair_loss = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
      dh = beta * (sigmoid(z) - (1 - eps));
    }
    dlogps[c] = scale * dh / nc;
    dlogps[r] = -scale * dh / nr;
    loss += pair_loss;
    s.loss += pair_loss;
    s.chosen_rewards += beta * chosen_ratio;
    s.rejected_rewards += beta * rejected_ratio;
    s.correct += chosen_ratio > rejected_ratio ? 1 : 0;
    s.chosen_logps += policy[c] / nc;
    s.rejected_logps += policy[r] / nr;
  }
  s.pairs = static_cast<int64_t>(pairs);
  if (stats) stats->add(s);

  const bool record = ag::should_record({&logps});
  ag::Var out(Tensor::full({1}, scale * loss, logps.dtype()), record);
  out.node()->is_leaf = false;
  if (!record) return out;
  ag::active_tape()->record([out_node = out.node(), in = logps.node(), dlogps]() {
    if (!out_node->grad.defined()) return;
    const double seed = out_node->grad.item();
    out_node->grad = Tensor();
    std::vector<double> g(dlogps.size());
    for (size_t i = 0; i < g.size(); ++i) g[i] = seed * dlogps[i];
    Tensor grad = Tensor::from<double>({static_cast<int64_t>(g.size())}, g);
    ag::accumulate(in, grad.to(in->dtype()).view(in->shape()));
  });
  return out;
}

}  // namespace pollen::train
