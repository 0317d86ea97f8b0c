#include "train/grpo_loss.h"

#include <algorithm>
#include <cmath>

#include "autograd/tape.h"
#include "base/error.h"

namespace pollen::train {

std::vector<double> group_advantages(std::span<const double> rewards, int64_t group_size,
                                     bool scale_by_std, double eps) {
  const int64_t n = static_cast<int64_t>(rewards.size());
  POLLEN_CHECK(group_size >= 1 && n % group_size == 0, "group_advantages: ", n,
               " rewards do not make groups of ", group_size);
  std::vector<double> advantages(rewards.size());
  for (int64_t g0 = 0; g0 < n; g0 += group_size) {
    double mean = 0;
    for (int64_t i = g0; i < g0 + group_size; ++i) mean += rewards[i];
    mean /= static_cast<double>(group_size);
    double var = 0;
    for (int64_t i = g0; i < g0 + group_size; ++i) var += (rewards[i] - mean) * (rewards[i] - mean);
    const double std = group_size > 1 ? std::sqrt(var / static_cast<double>(group_size - 1)) : 0.0;
    for (int64_t i = g0; i < g0 + group_size; ++i)
      advantages[i] = scale_by_std ? (rewards[i] - mean) / (std + eps) : rewards[i] - mean;
  }
  return advantages;
}

std::vector<double> token_weights(std::span<const int64_t> lengths, LossAggregation aggregation,
                                  int64_t max_completion_tokens) {
  int64_t total = 0;
  for (int64_t len : lengths) total += len;
  const double completions = static_cast<double>(lengths.size());
  std::vector<double> weights;
  weights.reserve(static_cast<size_t>(total));
  for (int64_t len : lengths) {
    double w = 0;
    switch (aggregation) {
      case LossAggregation::sequence:
        w = 1.0 / (completions * static_cast<double>(len));
        break;
      case LossAggregation::token:
        w = 1.0 / static_cast<double>(total);
        break;
      case LossAggregation::constant:
        w = 1.0 / (completions * static_cast<double>(max_completion_tokens));
        break;
    }
    weights.insert(weights.end(), static_cast<size_t>(len), w);
  }
  return weights;
}

ag::Var clipped_policy_loss(const ag::Var& logp, const TokenTerms& terms,
                            const ClippedLossOptions& options, ClippedLossStats* stats) {
  const int64_t n = logp.value().numel();
  for (const auto* v : {&terms.old_logp, &terms.ref_logp, &terms.advantage, &terms.weight})
    POLLEN_CHECK(static_cast<int64_t>(v->size()) == n ||
                     (v == &terms.ref_logp && v->empty() && options.beta == 0),
                 "clipped_policy_loss: ", v->size(), " token terms for ", n, " log-probabilities");
  const bool f64 = logp.dtype() == DType::f64;
  POLLEN_CHECK(f64 || logp.dtype() == DType::f32, "clipped_policy_loss: logp must be f32 or f64");
  auto logp_at = [&](int64_t i) {
    return f64 ? logp.value().data<double>()[i]
               : static_cast<double>(logp.value().data<float>()[i]);
  };

  double loss = 0;
  ClippedLossStats s;
  std::vector<double> dloss(static_cast<size_t>(n), 0.0);  // d(loss)/d(logp_i)
  for (int64_t i = 0; i < n; ++i) {
    const double w = terms.weight[i];
    if (w == 0) continue;
    const double lp = logp_at(i), a = terms.advantage[i];
    const double ratio = std::exp(lp - terms.old_logp[i]);
    const double clipped_ratio = std::clamp(ratio, 1 - options.clip_low, 1 + options.clip_high);
    const bool clipped = clipped_ratio * a < ratio * a;
    double term = -std::min(ratio * a, clipped_ratio * a);
    double grad = clipped ? 0.0 : -a * ratio;
    if (options.beta != 0) {
      const double d = terms.ref_logp[i] - lp;
      const double kl = std::exp(d) - d - 1;
      term += options.beta * kl;
      grad += options.beta * (1 - std::exp(d));
      s.kl_sum += kl;
    }
    loss += w * term;
    dloss[i] = w * grad;
    ++s.tokens;
    s.clipped += clipped;
  }
  if (stats) *stats = s;

  const bool record = ag::should_record({&logp});
  ag::Var out(Tensor::full({1}, loss, logp.dtype()), record);
  out.node()->is_leaf = false;
  if (record) {
    ag::active_tape()->record([out = out.node(), in = logp.node(), dloss = std::move(dloss)]() {
      if (!out->grad.defined()) return;
      const double dy = out->grad.item();
      Tensor g = Tensor::empty(in->shape(), in->dtype());
      for (size_t i = 0; i < dloss.size(); ++i) {
        if (in->dtype() == DType::f64) {
          g.data<double>()[i] = dy * dloss[i];
        } else {
          g.data<float>()[i] = static_cast<float>(dy * dloss[i]);
        }
      }
      ag::accumulate(in, g);
      out->grad = Tensor();
    });
  }
  return out;
}

}  // namespace pollen::train
