// AdamW over one parameter tensor, and the global gradient norm with its clipping factor
// computed on the GPU (no host round trip between the norm and the update).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

// torch.optim.AdamW, in the CPU op's order of operations (src/ops/adamw.cpp) in fp32.
template <typename G>
__global__ void adamw_kernel(float* p, const G* grad, float* m, float* v, bf16_t* model_copy,
                             int64_t n, AdamWArgs a, const float* device_scale) {
  float scale = a.grad_scale;
  if (device_scale) {
    const float ds = *device_scale;
    if (!isfinite(ds)) return;  // a non-finite gradient norm: no step
    scale *= ds;
  }
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float g = load(grad, i) * scale;
    const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * g;
    const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * g * g;
    const float denom = sqrtf(vi) * a.inv_sqrt_bias_correction2 + a.eps;
    const float pi = p[i] * a.decay - a.step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (model_copy) model_copy[i] = __float2bfloat16(pi);
  }
}

// partials[block] = this block's part of the sum of squares (a fixed grid of
// kSumOfSquaresBlocks blocks, so the order of additions never changes).
template <typename T>
__global__ void sum_of_squares_kernel(const T* x, int64_t n, double* partials) {
  double acc = 0;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const double e = load(x, i);
    acc += e * e;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// total[0] += the partials, with one block of kSumOfSquaresBlocks threads.
__global__ void sum_partials_kernel(const double* partials, double* total) {
  const double s = block_sum(partials[threadIdx.x]);
  if (threadIdx.x == 0) total[0] += s;
}

__global__ void clip_factor_kernel(const double* total, double max_norm, float* norm_and_scale) {
  const double norm = sqrt(total[0]);
  double scale = 1.0;
  if (!isfinite(norm)) {
    scale = NAN;
  } else if (max_norm > 0 && norm > max_norm) {
    scale = max_norm / (norm + 1e-6);
  }
  norm_and_scale[0] = static_cast<float>(norm);
  norm_and_scale[1] = static_cast<float>(scale);
}

}  // namespace

void adamw(float* param, const void* grad, DType grad_type, float* exp_avg, float* exp_avg_sq,
           void* model_copy, int64_t n, const AdamWArgs& args, const float* device_scale) {
  dispatch("adamw (grad)", grad_type, [&](auto tag) {
    using G = decltype(tag);
    adamw_kernel<G><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        param, static_cast<const G*>(grad), exp_avg, exp_avg_sq, static_cast<bf16_t*>(model_copy),
        n, args, device_scale);
    POLLEN_CUDA_CHECK_LAUNCH("adamw", "n=", n);
  });
}

void sum_of_squares_accumulate(DType t, const void* x, int64_t n, double* partials, double* total) {
  static_assert(kSumOfSquaresBlocks % 32 == 0 && kSumOfSquaresBlocks <= 1024);
  dispatch("sum_of_squares", t, [&](auto tag) {
    using T = decltype(tag);
    sum_of_squares_kernel<T><<<kSumOfSquaresBlocks, kThreads, 0, default_stream()>>>(
        static_cast<const T*>(x), n, partials);
    POLLEN_CUDA_CHECK_LAUNCH("sum_of_squares", "n=", n);
  });
  sum_partials_kernel<<<1, kSumOfSquaresBlocks, 0, default_stream()>>>(partials, total);
  POLLEN_CUDA_CHECK_LAUNCH("sum_of_squares (partials)", "n=", n);
}

void clip_factor(const double* total, double max_norm, float* norm_and_scale) {
  clip_factor_kernel<<<1, 1, 0, default_stream()>>>(total, max_norm, norm_and_scale);
  POLLEN_CUDA_CHECK_LAUNCH("clip_factor", "max_norm=", max_norm);
}

}  // namespace pollen::ops::cuda
