#pragma once
#include "tensor/tensor.h"

namespace pollen::ops {

// out (N,C) = table (V,C) rows at ids (N) int32; an id outside [0, V) is an error naming it.
// On the GPU (f32 or bf16) the ids are checked on the host, from a copy.
void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);
// dtable (V,C) += scatter of dout (N,C) at ids; on the GPU each row's tokens are summed in fp32 in
// token order, then added (deterministic, no atomics).
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable);

}  // namespace pollen::ops
