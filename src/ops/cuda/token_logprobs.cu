// Token log-probabilities over one block of rows of logits: one block of threads per row, the
// log-sum-exp and the target's log-probability forward, the gradient through the softmax in
// backward, written over the logits (or to a bf16 copy).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

constexpr int kRowThreads = 512;

// logits (nb,V) -> lse (nb), logp (nb): one block per row.
__global__ void token_logprob_rows_kernel(const float* logits, const int32_t* targets, int64_t v,
                                          float* logp, float* lse) {
  const float* row = logits + blockIdx.x * v;
  const auto [mx, sum] = row_exp_sum(row, v);
  if (threadIdx.x != 0) return;
  const double row_lse = static_cast<double>(mx) + log(static_cast<double>(sum));
  const int32_t t = targets[blockIdx.x];
  lse[blockIdx.x] = static_cast<float>(row_lse);
  logp[blockIdx.x] = t < 0 ? 0.0f : static_cast<float>(static_cast<double>(row[t]) - row_lse);
}

// logits (nb,V) replaced by g * (onehot(target) - exp(logits - lse)), g = dlogp * scale (0 when
// the row is not scored), or that written to grad_bf16 when given: one block per row.
__global__ void token_logprob_grad_rows_kernel(float* logits, const int32_t* targets,
                                               const float* dlogp, const float* lse, int64_t v,
                                               float scale, bf16_t* grad_bf16) {
  float* row = logits + blockIdx.x * v;
  bf16_t* grad_row = grad_bf16 ? grad_bf16 + blockIdx.x * v : nullptr;
  const int32_t t = targets[blockIdx.x];
  const float g = t < 0 ? 0.0f : dlogp[blockIdx.x] * scale, row_lse = lse[blockIdx.x];
  // Each element is read and written by one thread only, so the target's needs no ordering.
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float d = -g * expf(row[j] - row_lse);
    store_grad(row, grad_row, j, j == t ? d + g : d);
  }
}

}  // namespace

void token_logprob_rows(const float* logits, const int32_t* targets, int64_t nb, int64_t v,
                        float* logp, float* lse) {
  if (nb == 0) return;
  token_logprob_rows_kernel<<<static_cast<unsigned>(nb), kRowThreads, 0, default_stream()>>>(
      logits, targets, v, logp, lse);
  POLLEN_CUDA_CHECK_LAUNCH("token_logprob_rows", "rows=", nb, " vocab=", v);
}

void token_logprob_grad_rows(float* logits, const int32_t* targets, const float* dlogp,
                             const float* lse, int64_t nb, int64_t v, float scale,
                             void* grad_bf16) {
  if (nb == 0) return;
  token_logprob_grad_rows_kernel<<<static_cast<unsigned>(nb), kRowThreads, 0, default_stream()>>>(
      logits, targets, dlogp, lse, v, scale, static_cast<bf16_t*>(grad_bf16));
  POLLEN_CUDA_CHECK_LAUNCH("token_logprob_grad_rows", "rows=", nb, " vocab=", v);
}

}  // namespace pollen::ops::cuda
