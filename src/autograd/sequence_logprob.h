#pragma once
// Per-sequence log-probabilities of completions, as preference and RL objectives need them: the
// sum over a row's scored positions of log softmax(h w^T)[target]. The logits are never stored
// (see ops/cross_entropy.h): forward scores each row's block of positions, backward runs the
// fused cross-entropy again per row with that row's incoming gradient as its scale.
#include <cstdint>

#include "autograd/tape.h"

namespace pollen::ag {

// Sum over each row's scored positions of log softmax(h w^T)[target], h (B*T,C), w (V,C),
// targets (B*T) int32 (negative: not scored), rows B -> (B).
Var sequence_logprobs(const Var& h, const Var& w, const Tensor& targets, int64_t rows);

}  // namespace pollen::ag
