#pragma once
// Differentiable functions: each runs its op's forward now and, when recording, puts its
// backward on the active tape. Shapes: N tokens, C model width, V vocabulary, F MLP width,
// (B,T,H,D) for attention heads.
#include <functional>
#include <vector>

#include "autograd/tape.h"
#include "ops/rope.h"

namespace pollen::ag {

// Rows of table (V,C) at ids (N) int32 -> (N,C).
Var embedding(const Var& table, const Tensor& ids);

// x (N,K) @ w^T with w (M,K) [+ bias (M)] -> (N,M), as torch.nn.Linear.
Var linear(const Var& x, const Var& w, const Var* bias = nullptr);

// RMSNorm over the last dim: x (N,C), w (C).
Var rmsnorm(const Var& x, const Var& w, double eps);

// Rotary embedding on x (B,T,H,D) at positions (B,T) int32.
Var rope(const Var& x, const Tensor& positions, const ops::RopeParams& params);

// Causal grouped-query attention within documents: q (B,T,H,D), k, v (B,T,KVH,D),
// seg_start (B,T) int32 from ops::segment_starts -> (B,T,H,D).
Var attention(const Var& q, const Var& k, const Var& v, const Tensor& seg_start, double scale);

Var swiglu(const Var& gate, const Var& up);  // silu(gate) * up
Var add(const Var& a, const Var& b);
Var reshape(const Var& x, const Shape& shape);  // shares storage
// x's first n rows (along dim 0), sharing storage; the gradient reaches those rows alone.
Var leading_rows(const Var& x, int64_t n);

// Sum (reduction "sum") or mean over scored rows ("mean") of the cross-entropy of
// softmax(h w^T) against targets (N) int32 (negative targets are ignored) -> a scalar.
// h (N,C), w (V,C). The logits are never stored; see ops/cross_entropy.h.
enum class Reduction { mean, sum };
Var cross_entropy(const Var& h, const Var& w, const Tensor& targets, Reduction reduction,
                  int64_t* scored = nullptr);

// Runs fn(inputs) without keeping its activations; backward runs it again under a tape
// (activation recomputation). fn must be deterministic. `captured`: parameters fn reads without
// taking them as inputs; the call is recorded when an input or one of them wants a gradient
// (a frozen model's layer whose only trainable parameters are LoRA adapters).
Var checkpoint(const std::function<Var(const std::vector<Var>&)>& fn,
               const std::vector<Var>& inputs, const std::vector<Var>& captured = {});

}  // namespace pollen::ag
