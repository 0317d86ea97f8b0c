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

  // One update from the parameters' accumulated gradients; returns the gradient norm before
  // clipping. Parameters without a gradient are left as they are.
  double step(double lr);
  void zero_grad();

  int64_t steps_taken() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  // The optimizer state per parameter (exp_avg, exp_avg_sq), for checkpoints.
  const std::vector<ops::AdamWSlot>& slots() const { return slots_; }

 private:
  std::vector<ag::Var> params_;
  std::vector<ops::AdamWSlot> slots_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

// Global L2 norm of the gradients of `params` (those that have one).
double grad_norm(const std::vector<ag::Var>& params);

}  // namespace pollen::optim
