// AdamW over lists of parameter tensors, and the global gradient norm with its clipping factor
// computed on the GPU (no host round trip between the norm and the update). A list of up to
// kMultiTensors tensors travels in the kernel's parameters; every thread walks the list in order
// with a grid-stride loop over each tensor, so a step takes a few launches, not one per tensor.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

template <typename T>
struct TensorList {
  T t[kMultiTensors];
  int count;
};

__device__ __forceinline__ float load_grad(const AdamWTensor& t, int64_t i) {
  return t.grad_bf16 ? load(static_cast<const bf16_t*>(t.grad), i)
                     : load(static_cast<const float*>(t.grad), i);
}

// torch.optim.AdamW, in the CPU op's order of operations (src/ops/adamw.cpp) in fp32.
__global__ void adamw_kernel(TensorList<AdamWTensor> list, AdamWArgs a, const float* device_scale) {
  float scale = a.grad_scale;
  if (device_scale) {
    const float ds = *device_scale;
    if (!isfinite(ds)) return;  // a non-finite gradient norm: no step
    scale *= ds;
  }
  for (int k = 0; k < list.count; ++k) {
    const AdamWTensor& t = list.t[k];
    float *p = t.param, *m = t.exp_avg, *v = t.exp_avg_sq;
    bf16_t* model_copy = static_cast<bf16_t*>(t.model_copy);
    for (int64_t i = grid_start(); i < t.n; i += grid_stride()) {
      const float g = load_grad(t, i) * scale;
      const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * g;
      const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * g * g;
      const float denom = sqrtf(vi) * a.inv_sqrt_bias_correction2 + a.eps;
      const float pi = p[i] * t.decay - a.step_size * mi / denom;
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
      if (model_copy) model_copy[i] = __float2bfloat16(pi);
    }
  }
}

// partials[block] = this block's part of the sum of squares of the list (a fixed grid of
// kSumOfSquaresBlocks blocks, so the order of additions never changes).
__global__ void sum_of_squares_kernel(TensorList<SquaresTensor> list, double* partials) {
  double acc = 0;
  for (int k = 0; k < list.count; ++k) {
    const SquaresTensor& t = list.t[k];
    for (int64_t i = grid_start(); i < t.n; i += grid_stride()) {
      const double e = t.bf16 ? load(static_cast<const bf16_t*>(t.x), i)
                              : load(static_cast<const float*>(t.x), i);
      acc += e * e;
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// The tensors [first, first + kMultiTensors) of an array, as one kernel parameter.
template <typename T>
TensorList<T> list_from(const T* tensors, int64_t count, int64_t first) {
  TensorList<T> list{};
  list.count = static_cast<int>(count - first < kMultiTensors ? count - first : kMultiTensors);
  for (int k = 0; k < list.count; ++k) list.t[k] = tensors[first + k];
  return list;
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

void adamw(const AdamWTensor* tensors, int64_t count, const AdamWArgs& args,
           const float* device_scale) {
  for (int64_t first = 0; first < count; first += kMultiTensors) {
    const TensorList<AdamWTensor> list = list_from(tensors, count, first);
    int64_t largest = 0;
    for (int k = 0; k < list.count; ++k) largest = list.t[k].n > largest ? list.t[k].n : largest;
    adamw_kernel<<<grid_blocks(largest, kThreads), kThreads, 0, default_stream()>>>(list, args,
                                                                                    device_scale);
    POLLEN_CUDA_CHECK_LAUNCH("adamw", "tensors=", list.count, " largest=", largest);
  }
}

void sum_of_squares_accumulate(const SquaresTensor* tensors, int64_t count, double* partials,
                               double* total) {
  static_assert(kSumOfSquaresBlocks % 32 == 0 && kSumOfSquaresBlocks <= 1024);
  for (int64_t first = 0; first < count; first += kMultiTensors) {
    const TensorList<SquaresTensor> list = list_from(tensors, count, first);
    sum_of_squares_kernel<<<kSumOfSquaresBlocks, kThreads, 0, default_stream()>>>(list, partials);
    POLLEN_CUDA_CHECK_LAUNCH("sum_of_squares", "tensors=", list.count);
    sum_partials_kernel<<<1, kSumOfSquaresBlocks, 0, default_stream()>>>(partials, total);
    POLLEN_CUDA_CHECK_LAUNCH("sum_of_squares (partials)", "tensors=", list.count);
  }
}

void clip_factor(const double* total, double max_norm, float* norm_and_scale) {
  clip_factor_kernel<<<1, 1, 0, default_stream()>>>(total, max_norm, norm_and_scale);
  POLLEN_CUDA_CHECK_LAUNCH("clip_factor", "max_norm=", max_norm);
}

}  // namespace pollen::ops::cuda
