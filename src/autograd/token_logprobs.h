#pragma once
// The log-probability of each row's target under softmax(h w^T / temperature), differentiable in
// h and w: what policy-gradient objectives weight token by token (at their sampling temperature).
#include "autograd/tape.h"

namespace pollen::ag {

// h (N,C), w (V,C), targets (N) int32 (negative: not scored, log-probability 0) -> (N).
Var token_logprobs(const Var& h, const Var& w, const Tensor& targets, double temperature = 1.0);

}  // namespace pollen::ag
