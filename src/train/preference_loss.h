#pragma once
// The losses of learning from preference pairs, with their gradients written beside them:
// DPO's sigmoid loss (with conservative label smoothing), IPO's squared loss, and the
// Bradley-Terry loss of a reward model (the sigmoid loss on scores, beta 1, no reference).
//
// For pair i with policy log-probabilities pc, pr and reference log-probabilities rc, rr of the
// chosen and rejected completions, h = (pc - rc) - (pr - rr) and
//   sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
//   ipo:     (h - 1 / (2 beta))^2, with each log-probability divided by its completion's length
//            (as TRL and the IPO paper do).
// The rewards are beta (pc - rc) and beta (pr - rr) (IPO: of the per-token means), as TRL
// reports them.
#include <cstdint>
#include <string>
#include <vector>

#include "autograd/tape.h"
#include "dist/communicator.h"

namespace pollen::train {

enum class PreferenceLossKind { sigmoid, ipo };

// "sigmoid" or "ipo"; anything else is refused naming the choices (`where` names the key).
PreferenceLossKind preference_loss_named(const std::string& name, const std::string& where);

struct PreferenceLossOptions {
  PreferenceLossKind kind = PreferenceLossKind::sigmoid;
  double beta = 0.1;
  double label_smoothing = 0;  // eps of conservative DPO, in [0, 0.5); sigmoid only
};

// Sums over the pairs seen so far, for the metrics.
struct PreferenceStats {
  int64_t pairs = 0;
  double loss = 0, chosen_rewards = 0, rejected_rewards = 0, correct = 0;
  double chosen_logps = 0, rejected_logps = 0;
  void add(const PreferenceStats& other);
  // Every rank's sums (and `tokens`) summed over the ranks of `comm`.
  void sum_over(dist::Communicator& comm, int64_t& tokens);
  // rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
  // logps/rejected: means over the pairs.
  std::vector<std::pair<std::string, double>> means() const;
};

// logps (2P): the policy's log-probabilities (or scores), P chosen then P rejected; reference
// (2P) in the same order (zeros for none); lengths (2P): completion tokens (used by IPO).
// Returns `scale` times the sum over pairs of the loss, a scalar whose backward reaches logps.
ag::Var preference_loss(const ag::Var& logps, const std::vector<double>& reference,
                        const std::vector<int64_t>& lengths, const PreferenceLossOptions& options,
                        double scale, PreferenceStats* stats = nullptr);

}  // namespace pollen::train
