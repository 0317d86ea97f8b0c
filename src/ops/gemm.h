#pragma once
// General matrix multiply on 2-D tensors through BLAS:
//   c (M,N) = alpha * op(a) @ op(b) + beta * c,  op(a) = a (M,K) or a^T when a is (K,M).
// beta = 0 overwrites c (whatever it held), beta = 1 accumulates into it (gradients).
// On the CPU a, b and c are f32 or f64. On the GPU (cuBLASLt, fp32 accumulation, no TF32) a and b
// are f32 or bf16, and c is f32, or bf16 when a and b are.
#include "tensor/tensor.h"

namespace pollen::ops {

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
          double alpha = 1.0, double beta = 0.0);

}  // namespace pollen::ops
