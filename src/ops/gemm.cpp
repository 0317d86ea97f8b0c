#include "ops/gemm.h"

#include "ops/check.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/profile.h"

namespace pollen::ops {

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
          double beta) {
  const OpTimer timer("gemm", c);
  POLLEN_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "gemm: expected 2-D tensors, got ",
               shape_str(a.shape()), ", ", shape_str(b.shape()), ", ", shape_str(c.shape()));
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  const DType dt = a.dtype();
  const Device dev = a.device();
  expect("gemm", "a", a, a.shape(), dt, dev);
  expect("gemm", "b", b, {trans_b ? n : k, trans_b ? k : n}, dt, dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) {
    // c may be f32 under bf16 a and b (fp32 accumulation either way).
    expect("gemm", "c", c, {m, n}, c.dtype(), dev);
    return cuda::gemm(dt, a.raw(), trans_a, b.raw(), trans_b, c.dtype(), c.raw(), m, n, k, alpha,
                      beta);
  }
#endif
  expect("gemm", "c", c, {m, n}, dt);
  dispatch_float("gemm", dt, [&]<typename T>(T) {
    cpu::gemm<T>(a.data<T>(), trans_a, b.data<T>(), trans_b, c.data<T>(), m, n, k,
                 static_cast<T>(alpha), static_cast<T>(beta));
  });
}

}  // namespace pollen::ops
