#pragma once
// Rotary position embedding with the HF LlamaForCausalLM convention: dimension i is paired with
// i + D/2 (rotate_half), inv_freq[i] = theta^(-2i/D), angle = position * inv_freq[i] in double,
// out = x * cos + rotate_half(x) * sin.
#include "tensor/tensor.h"

namespace pollen::ops {

// x (B,T,H,D) with D even (H may count query heads or kv heads); positions (B,T) int32 >= 0
// (they restart per document in packed sequences). out (B,T,H,D) may be x itself (in place).
void rope_forward(const Tensor& x, const Tensor& positions, double theta, Tensor& out);

// The transpose of rope_forward, a rotation by -angle: dx (B,T,H,D) from dout; dx may be dout.
void rope_backward(const Tensor& dout, const Tensor& positions, double theta, Tensor& dx);

}  // namespace pollen::ops
