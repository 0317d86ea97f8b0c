// The softmax part of cross-entropy over one block of rows of logits: one block of threads per
// row, the loss in f64, the gradient written over the logits.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

constexpr int kRowThreads = 512;

__global__ void softmax_cross_entropy_kernel(float* logits, const int32_t* targets, int64_t v,
                                             double* row_loss, bool want_grad, float grad_scale,
                                             bf16_t* grad_bf16) {
  float* row = logits + blockIdx.x * v;
  bf16_t* grad_row = grad_bf16 ? grad_bf16 + blockIdx.x * v : nullptr;
  const int32_t t = targets[blockIdx.x];  // the same for the whole block: uniform branches
  if (t < 0) {
    if (threadIdx.x == 0) row_loss[blockIdx.x] = 0;
    if (want_grad)
      for (int64_t j = threadIdx.x; j < v; j += blockDim.x) store_grad(row, grad_row, j, 0.0f);
    return;
  }
  const float target_logit = row[t];  // read before any thread of the block writes the row
  const auto [mx, sum] = row_exp_sum(row, v);
  if (threadIdx.x == 0)
    row_loss[blockIdx.x] =
        static_cast<double>(mx) + log(static_cast<double>(sum)) - static_cast<double>(target_logit);
  if (!want_grad) return;
  const float inv = grad_scale / sum;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float g = expf(row[j] - mx) * inv;
    store_grad(row, grad_row, j, j == t ? g - grad_scale : g);
  }
}

}  // namespace

void softmax_cross_entropy_rows(float* logits, const int32_t* targets, int64_t nb, int64_t v,
                                double* row_loss, bool want_grad, float grad_scale,
                                void* grad_bf16) {
  if (nb == 0) return;
  softmax_cross_entropy_kernel<<<static_cast<unsigned>(nb), kRowThreads, 0, default_stream()>>>(
      logits, targets, v, row_loss, want_grad, grad_scale, static_cast<bf16_t*>(grad_bf16));
  POLLEN_CUDA_CHECK_LAUNCH("softmax_cross_entropy_rows", "rows=", nb, " vocab=", v);
}

}  // namespace pollen::ops::cuda
