#include "ops/elementwise.h"

#include "ops/check.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops {

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  expect("add", "b", b, a.shape(), a.dtype());
  expect("add", "out", out, a.shape(), a.dtype());
  dispatch_float("add", a.dtype(), [&]<typename T>(T) {
    cpu::add(a.data<T>(), b.data<T>(), out.data<T>(), a.numel());
  });
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  expect("mul", "b", b, a.shape(), a.dtype());
  expect("mul", "out", out, a.shape(), a.dtype());
  dispatch_float("mul", a.dtype(), [&]<typename T>(T) {
    cpu::mul(a.data<T>(), b.data<T>(), out.data<T>(), a.numel());
  });
}

void axpy(double alpha, const Tensor& x, Tensor& y) {
  expect("axpy", "x", x, y.shape(), y.dtype());
  dispatch_float("axpy", y.dtype(), [&]<typename T>(T) {
    cpu::axpy(static_cast<T>(alpha), x.data<T>(), y.data<T>(), y.numel());
  });
}

void scale_into(double alpha, const Tensor& x, Tensor& y) {
  expect("scale_into", "x", x, y.shape(), y.dtype());
  dispatch_float("scale_into", y.dtype(), [&]<typename T>(T) {
    cpu::scale_into(static_cast<T>(alpha), x.data<T>(), y.data<T>(), y.numel());
  });
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  expect("swiglu", "up", up, gate.shape(), gate.dtype());
  expect("swiglu", "out", out, gate.shape(), gate.dtype());
  dispatch_float("swiglu", gate.dtype(), [&]<typename T>(T) {
    cpu::swiglu_forward(gate.data<T>(), up.data<T>(), out.data<T>(), gate.numel());
  });
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  for (const Tensor* t :
       {&dout, &up, static_cast<const Tensor*>(&dgate), static_cast<const Tensor*>(&dup)})
    expect("swiglu_backward", "tensor", *t, gate.shape(), gate.dtype());
  dispatch_float("swiglu_backward", gate.dtype(), [&]<typename T>(T) {
    cpu::swiglu_backward(dout.data<T>(), gate.data<T>(), up.data<T>(), dgate.data<T>(),
                         dup.data<T>(), gate.numel());
  });
}

}  // namespace pollen::ops
