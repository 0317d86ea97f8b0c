#pragma once
// AdamW (Loshchilov & Hutter; PyTorch's torch.optim.AdamW semantics) fused over every parameter:
// one pass reads each gradient once, with the clipping factor folded in.
#include <vector>

#include "tensor/tensor.h"

namespace pollen::ops {

struct AdamWSlot {
  Tensor param, grad, exp_avg, exp_avg_sq;  // same shape and dtype
  double weight_decay = 0;                  // decoupled: param *= 1 - lr * weight_decay
};

struct AdamWHyper {
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // multiplies every gradient first (global-norm clipping)
};

void adamw_step(std::vector<AdamWSlot>& slots, const AdamWHyper& hyper);

// Sum of squares of every element of every tensor, in double, reduced in a fixed order.
double sum_of_squares(const std::vector<Tensor>& tensors);

}  // namespace pollen::ops
