// RMSNorm (HF LlamaRMSNorm) forward and backward: one block per row, fp32 math, the sum of
// squares in f64 as on the CPU.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

template <typename T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, T* y, float* rstd, int64_t c,
                                       double eps) {
  const int64_t base = blockIdx.x * c;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const double v = load(x, base + j);
    ss += v * v;
  }
  ss = block_sum(ss);
  const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(c) + eps));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x)
    store(y, base + j, load(x, base + j) * r * load(w, j));
}

// With xhat = x * r:  dx = r * (dy*w - xhat * mean(dy*w*xhat)) = r * (dy*w - x * coef),
// coef = r^2 * sum(dy*w*x) / c.
template <typename T>
__global__ void rmsnorm_dx_kernel(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                                  int64_t c, bool accumulate_dx) {
  const int64_t base = blockIdx.x * c;
  const float r = rstd[blockIdx.x];
  float dot = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x)
    dot += load(dy, base + j) * load(w, j) * load(x, base + j);
  dot = block_sum(dot);
  const float coef = dot * r * r / static_cast<float>(c);
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const float g = r * (load(dy, base + j) * load(w, j) - load(x, base + j) * coef);
    store(dx, base + j, accumulate_dx ? load(dx, base + j) + g : g);
  }
}

// dw[j] += sum over rows i of dy[i,j] * x[i,j] * rstd[i]: one thread per channel, rows in order.
template <typename T>
__global__ void rmsnorm_dw_kernel(const T* dy, const T* x, const float* rstd, T* dw, int64_t n,
                                  int64_t c) {
  const int64_t j = grid_start();
  if (j >= c) return;
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += load(dy, i * c + j) * load(x, i * c + j) * rstd[i];
  store(dw, j, load(dw, j) + sum);
}

}  // namespace

void rmsnorm_forward(DType t, const void* x, const void* w, void* y, float* rstd, int64_t n,
                     int64_t c, double eps) {
  if (n == 0) return;
  dispatch("rmsnorm", t, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, c, eps);
    POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_forward", "n=", n, " c=", c);
  });
}

void rmsnorm_backward(DType t, const void* dy, const void* x, const void* w, const float* rstd,
                      void* dx, void* dw, int64_t n, int64_t c, bool accumulate_dx) {
  if (n == 0) return;
  dispatch("rmsnorm_backward", t, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_dx_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
        static_cast<T*>(dx), c, accumulate_dx);
    POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_backward (dx)", "n=", n, " c=", c);
    const unsigned blocks = static_cast<unsigned>((c + kThreads - 1) / kThreads);
    rmsnorm_dw_kernel<T><<<blocks, kThreads, 0, default_stream()>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), rstd, static_cast<T*>(dw), n, c);
    POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_backward (dw)", "n=", n, " c=", c);
  });
}

}  // namespace pollen::ops::cuda
