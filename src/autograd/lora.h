#pragma once
// Differentiable low-rank adaptation (LoRA, Hu et al. 2021) of a linear layer, as PEFT computes
// it: the frozen or trained base x W^T plus scale * dropout(x) A^T B^T, with the dropout applied
// to the adapter's input only. Shapes: N rows, K inputs, M outputs, r the rank.
#include "autograd/tape.h"

namespace pollen::ag {

// x (N,K) W^T (+ bias (M)) + scale * (x * mask) A^T B^T -> (N,M); W (M,K), A (r,K), B (M,r).
// mask (N,K) holds the dropout's 0 or 1/(1-p) per element; undefined means no dropout.
Var lora_linear(const Var& x, const Var& w, const Var* bias, const Var& a, const Var& b,
                double scale, const Tensor& mask);

// The adapted weight as one matrix, W + scale * B A -> (M,K): for the LM head, whose fused
// cross-entropy takes one matrix (no dropout there).
Var lora_weight(const Var& w, const Var& a, const Var& b, double scale);

}  // namespace pollen::ag
