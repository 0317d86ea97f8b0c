#include "ops/elementwise.h"

#include "ops/check.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/profile.h"

namespace pollen::ops {

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const OpTimer timer("add", out);
  const Device dev = a.device();
  expect("add", "a", a, a.shape(), a.dtype(), dev);
  expect("add", "b", b, a.shape(), a.dtype(), dev);
  expect("add", "out", out, a.shape(), a.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) return cuda::add(a.dtype(), a.raw(), b.raw(), out.raw(), a.numel());
#endif
  dispatch_float("add", a.dtype(), [&]<typename T>(T) {
    cpu::add(a.data<T>(), b.data<T>(), out.data<T>(), a.numel());
  });
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  const OpTimer timer("mul", out);
  const Device dev = a.device();
  expect("mul", "a", a, a.shape(), a.dtype(), dev);
  expect("mul", "b", b, a.shape(), a.dtype(), dev);
  expect("mul", "out", out, a.shape(), a.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) return cuda::mul(a.dtype(), a.raw(), b.raw(), out.raw(), a.numel());
#endif
  dispatch_float("mul", a.dtype(), [&]<typename T>(T) {
    cpu::mul(a.data<T>(), b.data<T>(), out.data<T>(), a.numel());
  });
}

void axpy(double alpha, const Tensor& x, Tensor& y) {
  const OpTimer timer("axpy", y);
  const Device dev = y.device();
  expect("axpy", "y", y, y.shape(), y.dtype(), dev);
  expect("axpy", "x", x, y.shape(), y.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) return cuda::axpy(y.dtype(), alpha, x.raw(), y.raw(), y.numel());
#endif
  dispatch_float("axpy", y.dtype(), [&]<typename T>(T) {
    cpu::axpy(static_cast<T>(alpha), x.data<T>(), y.data<T>(), y.numel());
  });
}

void scale_into(double alpha, const Tensor& x, Tensor& y) {
  const OpTimer timer("scale", y);
  const Device dev = y.device();
  expect("scale_into", "y", y, y.shape(), y.dtype(), dev);
  expect("scale_into", "x", x, y.shape(), y.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) return cuda::scale_into(y.dtype(), alpha, x.raw(), y.raw(), y.numel());
#endif
  dispatch_float("scale_into", y.dtype(), [&]<typename T>(T) {
    cpu::scale_into(static_cast<T>(alpha), x.data<T>(), y.data<T>(), y.numel());
  });
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  const OpTimer timer("swiglu_forward", out);
  const Device dev = gate.device();
  expect("swiglu", "gate", gate, gate.shape(), gate.dtype(), dev);
  expect("swiglu", "up", up, gate.shape(), gate.dtype(), dev);
  expect("swiglu", "out", out, gate.shape(), gate.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda)
    return cuda::swiglu_forward(gate.dtype(), gate.raw(), up.raw(), out.raw(), gate.numel());
#endif
  dispatch_float("swiglu", gate.dtype(), [&]<typename T>(T) {
    cpu::swiglu_forward(gate.data<T>(), up.data<T>(), out.data<T>(), gate.numel());
  });
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  const OpTimer timer("swiglu_backward", dgate);
  const Device dev = gate.device();
  for (const Tensor* t :
       {&dout, &gate, &up, static_cast<const Tensor*>(&dgate), static_cast<const Tensor*>(&dup)})
    expect("swiglu_backward", "tensor", *t, gate.shape(), gate.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda)
    return cuda::swiglu_backward(gate.dtype(), dout.raw(), gate.raw(), up.raw(), dgate.raw(),
                                 dup.raw(), gate.numel());
#endif
  dispatch_float("swiglu_backward", gate.dtype(), [&]<typename T>(T) {
    cpu::swiglu_backward(dout.data<T>(), gate.data<T>(), up.data<T>(), dgate.data<T>(),
                         dup.data<T>(), gate.numel());
  });
}

}  // namespace pollen::ops
