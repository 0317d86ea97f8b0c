#pragma once
// AdamW (Loshchilov & Hutter; PyTorch's torch.optim.AdamW semantics) fused over every parameter:
// one pass reads each gradient once, with the clipping factor folded in.
#include <vector>

#include "tensor/tensor.h"

namespace pollen::ops {

// On the CPU every tensor of a slot has one shape and dtype. On the GPU (mixed precision) param,
// exp_avg and exp_avg_sq are f32 (the master weights and the state), grad is f32 or bf16, and
// model_copy, when defined, is a bf16 tensor of param's shape that receives the updated weights.
struct AdamWSlot {
  Tensor param, grad, exp_avg, exp_avg_sq;
  double weight_decay = 0;  // decoupled: param *= 1 - lr * weight_decay
  Tensor model_copy;        // GPU only: the bf16 weights the model computes with
};

struct AdamWHyper {
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // multiplies every gradient first (global-norm clipping)
  // GPU only: clip_factor's (2) f32 tensor; gradients are also multiplied by its factor, read on
  // the GPU, and a non-finite factor (a non-finite norm) leaves every slot unchanged.
  Tensor device_clip;
};

// All slots on one device; one pass per slot over its elements.
void adamw_step(std::vector<AdamWSlot>& slots, const AdamWHyper& hyper);

// Sum of squares of every element of every tensor, in double, reduced in a fixed order (tensors
// on the GPU are reduced there, and the total copied back).
double sum_of_squares(const std::vector<Tensor>& tensors);

// For clipping on the GPU without a host round trip: a (2) f32 tensor on the GPU holding the
// global norm of `grads` (f32 or bf16, on the GPU) and the clipping factor
// max_norm / (norm + 1e-6) when max_norm > 0 and norm > max_norm, else 1 (as optim::AdamW); the
// factor is NaN when the norm is not finite. Nothing waits for the GPU.
Tensor clip_factor(const std::vector<Tensor>& grads, double max_norm);

}  // namespace pollen::ops
