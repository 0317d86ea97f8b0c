#pragma once
// Per-token log-probabilities through the output projection (the LM head): log softmax(h w^T / T)
// at each row's target (T the sampling temperature, 1 for the model's own distribution), computed
// over blocks of rows so that at most (block_rows, V) logits exist at a time. Backward recomputes
// each block's logits from the saved log-sum-exp. Policy-gradient objectives (GRPO) weight every
// token's log-probability differently, which the summed cross-entropy cannot express.
#include <cstdint>

#include "tensor/tensor.h"

namespace pollen::ops {

// h (N,C), w (V,C), targets (N) int32 (negative: not scored), all on one device: f32 or f64 on
// the CPU, f32 or bf16 on the GPU. Writes logp (N) (0 for unscored rows) and lse (N), the
// log-sum-exp of each row's logits (kept for backward), in statistics_dtype(h) (ops/check.h):
// h's dtype on the CPU, f32 on the GPU.
// lse is that of the logits divided by `temperature` (> 0).
void token_logprobs_forward(const Tensor& h, const Tensor& w, const Tensor& targets, Tensor& logp,
                            Tensor& lse, double temperature = 1.0, int64_t block_rows = 0);

// dlogp (N): d(loss)/d(logp), in logp's dtype. Overwrites dh (N,C) with d(loss)/dh and accumulates
// d(loss)/dw into dw (V,C) (undefined dw: not computed, a frozen head's GEMM saved): for row i, d
// logp_i / d logits_i = (onehot(target_i) - softmax(logits_i / T)) / T. `temperature` and lse as
// the forward's.
void token_logprobs_backward(const Tensor& dlogp, const Tensor& h, const Tensor& w,
                             const Tensor& targets, const Tensor& lse, Tensor& dh, Tensor& dw,
                             double temperature = 1.0, int64_t block_rows = 0);

}  // namespace pollen::ops
