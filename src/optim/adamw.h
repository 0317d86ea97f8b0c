#pragma once
// The AdamW optimizer over a model's parameters, with decoupled weight decay applied only to
// matrices (not to norms and biases, as is usual for transformers) and global-norm clipping
// folded into the fused update.
#include <string>
#include <vector>

#include "autograd/var.h"
#include "ops/adamw.h"

namespace pollen::optim {

struct AdamWOptions {
  double lr = 3e-4;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  double max_grad_norm = 1.0;  // 0 disables clipping
};

class AdamW {
 public:
  AdamW(std::vector<ag::Var> params, const AdamWOptions& options);
  // With an explicit choice per parameter of whether weight decay applies (no-decay groups).
  AdamW(std::vector<ag::Var> params, const AdamWOptions& options, const std::vector<bool>& decay);

  // One update from the parameters' accumulated gradients; returns the gradient norm before
  // clipping. Parameters without a gradient are left as they are. A non-finite gradient norm
  // changes nothing (no update, no step counted) and is returned for the caller to report.
  double step(double lr);
  void zero_grad();

  // Mixed precision, GPU only: from here on each parameter's value is a bf16 copy of its weights,
  // which the model computes with (so its gradients come in bf16). The f32 weights stay in the
  // slots as master weights beside the f32 moments, and every step rewrites the copies from them.
  void compute_in_bf16();
  bool computes_in_bf16() const { return !slots_.empty() && slots_[0].model_copy.defined(); }
  // Rewrites the bf16 copies from the master weights (after loading these from a checkpoint).
  void refresh_model_copies();

  int64_t steps_taken() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  // The optimizer state per parameter (the f32 weights in param, exp_avg, exp_avg_sq), for
  // checkpoints.
  const std::vector<ops::AdamWSlot>& slots() const { return slots_; }
  std::vector<ops::AdamWSlot>& slots() { return slots_; }
  // Bytes of the moments (exp_avg and exp_avg_sq) over every parameter.
  int64_t state_bytes() const {
    int64_t bytes = 0;
    for (const auto& slot : slots_)
      bytes += static_cast<int64_t>(slot.exp_avg.nbytes() + slot.exp_avg_sq.nbytes());
    return bytes;
  }
  // Restoring from a checkpoint: the count of updates already taken (for bias correction).
  void set_steps_taken(int64_t steps) { step_ = steps; }

 private:
  std::vector<ag::Var> params_;
  std::vector<ops::AdamWSlot> slots_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

// Global L2 norm of the gradients of `params` (those that have one).
double grad_norm(const std::vector<ag::Var>& params);

}  // namespace pollen::optim
