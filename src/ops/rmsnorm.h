#pragma once
#include "tensor/tensor.h"

namespace pollen::ops {

// y (N,C) = x / sqrt(mean(x^2) + eps) * w (C); rstd (N) is saved for the backward pass.
// CPU: f32 or f64, rstd in x's dtype. GPU: x, w, y f32 or bf16 (fp32 math), rstd f32.
void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
// dx (N,C) = (or +=, when accumulate_dx) the input gradient; dw (C) += the weight gradient.
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool accumulate_dx);

}  // namespace pollen::ops
