#pragma once
// Elementwise ops on same-shaped contiguous tensors of one dtype on one device: f32 or f64 on the
// CPU, f32 or bf16 (fp32 math) on the GPU.
#include "tensor/tensor.h"

namespace pollen::ops {

void add(const Tensor& a, const Tensor& b, Tensor& out);    // out = a + b (residual connections)
void mul(const Tensor& a, const Tensor& b, Tensor& out);    // out = a * b (dropout masks)
void axpy(double alpha, const Tensor& x, Tensor& y);        // y += alpha * x
void scale_into(double alpha, const Tensor& x, Tensor& y);  // y = alpha * x

// SwiGLU: out = silu(gate) * up; backward writes dgate and dup.
void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup);

}  // namespace pollen::ops
