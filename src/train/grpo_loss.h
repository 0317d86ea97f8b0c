#pragma once
// The GRPO objective's arithmetic (DeepSeekMath, Shao et al. 2024), apart from sampling:
// group-normalised advantages and the clipped policy-ratio loss with an optional KL penalty.
//
// Per completion token t with log-probability logp under the policy being trained, old_logp
// under the policy that sampled it, ref_logp under the reference, and its completion's
// advantage A:
//   ratio = exp(logp - old_logp)
//   term  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
//           + beta * (exp(ref_logp - logp) - (ref_logp - logp) - 1)      (k3 KL estimator)
// and the loss is sum_t weight_t * term_t, the weights saying how tokens are averaged
// (token_weights).
#include <cstdint>
#include <span>
#include <vector>

#include "autograd/var.h"

namespace pollen::train {

// (r - mean(group)) / (std(group) + eps) for each group of `group_size` consecutive rewards, or
// r - mean(group) without `scale_by_std` (Dr. GRPO). std is the sample standard deviation (n - 1),
// as TRL computes it.
std::vector<double> group_advantages(std::span<const double> rewards, int64_t group_size,
                                     bool scale_by_std, double eps = 1e-4);

// How completion tokens are averaged into the loss:
// sequence: the mean over each completion's tokens, then over completions (DeepSeekMath's GRPO);
// token:    the mean over every completion token of the batch (DAPO);
// constant: the sum over tokens divided by completions * max_completion_tokens (Dr. GRPO).
enum class LossAggregation { sequence, token, constant };

// Each token's weight for completions of the given lengths (completion i's tokens are
// lengths[i] consecutive entries).
std::vector<double> token_weights(std::span<const int64_t> lengths, LossAggregation aggregation,
                                  int64_t max_completion_tokens);

struct ClippedLossOptions {
  double clip_low = 0.2, clip_high = 0.2;
  double beta = 0.0;  // KL coefficient; 0: no KL term (ref_logp unused)
};

// Per scored row of `logp` (rows with weight 0 are not completion tokens and get no gradient).
struct TokenTerms {
  std::vector<double> old_logp, ref_logp, advantage, weight;
};

// Weighted sums over the rows, for metrics (divide by the number of tokens).
struct ClippedLossStats {
  int64_t tokens = 0;   // rows with weight > 0
  int64_t clipped = 0;  // rows whose clipped term was the smaller (no gradient from ratio)
  double kl_sum = 0;    // sum of the k3 estimate over those rows
};

// logp (N) -> the scalar loss (1); backward gives d(loss)/d(logp_t) =
// weight_t * (-A_t * ratio_t [when not clipped] + beta * (1 - exp(ref_logp_t - logp_t))).
ag::Var clipped_policy_loss(const ag::Var& logp, const TokenTerms& terms,
                            const ClippedLossOptions& options, ClippedLossStats* stats = nullptr);

}  // namespace pollen::train
