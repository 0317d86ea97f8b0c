// RMSNorm (HF LlamaRMSNorm) forward and backward: one block per row, fp32 math, the sum of
// squares in f64 as on the CPU. dw sums over all rows in two passes (chunks of rows side by side,
// then the chunks in order), so that a long batch keeps the whole GPU busy and the sum stays
// deterministic.
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

// dw's first pass: partials[k, j] = the sum over rows i of chunk k of dy[i,j] * x[i,j] * rstd[i],
// rows in order; grid (channel tiles, chunks), one thread per channel of the tile.
template <typename T>
__global__ void rmsnorm_dw_partial_kernel(const T* dy, const T* x, const float* rstd,
                                          float* partials, int64_t n, int64_t c,
                                          int64_t chunk_rows) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= c) return;
  const int64_t first = blockIdx.y * chunk_rows, end = min(n, first + chunk_rows);
  float sum = 0;
  for (int64_t i = first; i < end; ++i) sum += load(dy, i * c + j) * load(x, i * c + j) * rstd[i];
  partials[blockIdx.y * c + j] = sum;
}

// dw's second pass: dw[j] += the chunks' partials[:, j] summed in chunk order, rounded once.
template <typename T>
__global__ void rmsnorm_dw_finish_kernel(const float* partials, int64_t chunks, T* dw, int64_t c) {
  for (int64_t j = grid_start(); j < c; j += grid_stride()) {
    float sum = 0;
    for (int64_t k = 0; k < chunks; ++k) sum += partials[k * c + j];
    store(dw, j, load(dw, j) + sum);
  }
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
                      void* dx, void* dw, float* dw_partials, int64_t n, int64_t c,
                      bool accumulate_dx) {
  if (n == 0 || c == 0) return;  // an empty grid is not a launch CUDA takes
  dispatch("rmsnorm_backward", t, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_dx_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
        static_cast<T*>(dx), c, accumulate_dx);
    POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_backward (dx)", "n=", n, " c=", c);
    const int64_t chunks = rmsnorm_dw_chunks(n), chunk_rows = (n + chunks - 1) / chunks;
    const dim3 grid(static_cast<unsigned>((c + kThreads - 1) / kThreads),
                    static_cast<unsigned>(chunks));
    rmsnorm_dw_partial_kernel<T><<<grid, kThreads, 0, default_stream()>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), rstd, dw_partials, n, c, chunk_rows);
    POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_backward (dw partials)", "n=", n, " c=", c,
                             " chunks=", chunks);
    rmsnorm_dw_finish_kernel<T><<<grid_blocks(c, kThreads), kThreads, 0, default_stream()>>>(
        dw_partials, chunks, static_cast<T*>(dw), c);
    POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_backward (dw)", "n=", n, " c=", c);
  });
}

}  // namespace pollen::ops::cuda
