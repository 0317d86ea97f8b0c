#include "ops/rmsnorm.h"

#include "ops/check.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/profile.h"

namespace pollen::ops {
void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const OpTimer timer("rmsnorm_forward", x);
  const int64_t c = w.numel(), n = x.numel() / (c ? c : 1);
  const DType dt = x.dtype();
  const Device dev = x.device();
  expect("rmsnorm", "x", x, {n, c}, dt, dev);
  expect("rmsnorm", "w", w, {c}, dt, dev);
  expect("rmsnorm", "y", y, {n, c}, dt, dev);
  expect("rmsnorm", "rstd", rstd, {n}, statistics_dtype(x), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda)
    return cuda::rmsnorm_forward(dt, x.raw(), w.raw(), y.raw(), rstd.data<float>(), n, c, eps);
#endif
  dispatch_float("rmsnorm", dt, [&]<typename T>(T) {
    cpu::rmsnorm_forward(x.data<T>(), w.data<T>(), y.data<T>(), rstd.data<T>(), n, c, eps);
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool accumulate_dx) {
  const OpTimer timer("rmsnorm_backward", x);
  const int64_t c = w.numel(), n = x.numel() / (c ? c : 1);
  const DType dt = x.dtype();
  const Device dev = x.device();
  expect("rmsnorm_backward", "dy", dy, {n, c}, dt, dev);
  expect("rmsnorm_backward", "x", x, {n, c}, dt, dev);
  expect("rmsnorm_backward", "w", w, {c}, dt, dev);
  expect("rmsnorm_backward", "rstd", rstd, {n}, statistics_dtype(x), dev);
  expect("rmsnorm_backward", "dx", dx, {n, c}, dt, dev);
  expect("rmsnorm_backward", "dw", dw, {c}, dt, dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) {
    Tensor dw_partials = Tensor::empty({cuda::rmsnorm_dw_chunks(n), c}, DType::f32, Device::cuda);
    return cuda::rmsnorm_backward(dt, dy.raw(), x.raw(), w.raw(), rstd.data<float>(), dx.raw(),
                                  dw.raw(), dw_partials.data<float>(), n, c, accumulate_dx);
  }
#endif
  dispatch_float("rmsnorm_backward", dt, [&]<typename T>(T) {
    cpu::rmsnorm_backward(dy.data<T>(), x.data<T>(), w.data<T>(), rstd.data<T>(), dx.data<T>(),
                          dw.data<T>(), n, c, accumulate_dx);
  });
}

}  // namespace pollen::ops
