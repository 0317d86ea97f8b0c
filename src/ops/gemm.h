#pragma once
// General matrix multiply on 2-D tensors through BLAS:
//   c (M,N) = alpha * op(a) @ op(b) + beta * c,  op(a) = a (M,K) or a^T when a is (K,M).
// beta = 0 overwrites c (whatever it held), beta = 1 accumulates into it (gradients).
#include "tensor/tensor.h"

namespace pollen::ops {

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
          double alpha = 1.0, double beta = 0.0);

}  // namespace pollen::ops
