#pragma once
// For the kernels of src/ops/cuda: fp32 loads and stores of f32 and bf16 elements, the dtype
// switch, grid-stride loops and block reductions.
#include <cuda_bf16.h>

#include "tensor/cuda_context.h"
#include "tensor/dtype.h"

namespace pollen::ops::cuda {

using bf16_t = __nv_bfloat16;
using ::pollen::cuda::default_stream;
using ::pollen::cuda::grid_blocks;

constexpr int kThreads = 256;  // threads per block of the elementwise kernels

__device__ __forceinline__ float load(const float* p, int64_t i) {
  return p[i];
}
__device__ __forceinline__ float load(const bf16_t* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void store(bf16_t* p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);  // round to nearest even, as pollen's host bf16
}

// Element j of a row's gradient over a row of f32 logits, or into grad_row (bf16) when given: the
// bf16 GEMMs' input rounded once, without another pass over the f32 logits.
__device__ __forceinline__ void store_grad(float* row, bf16_t* grad_row, int64_t j, float g) {
  if (grad_row) {
    store(grad_row, j, g);
  } else {
    row[j] = g;
  }
}

// Calls f(float{}) or f(bf16_t{}) for the op's dtype; other dtypes are an error naming the op.
template <typename F>
void dispatch(const char* op, DType t, F&& f) {
  if (t == DType::f32) {
    f(float{});
  } else if (t == DType::bf16) {
    f(bf16_t{});
  } else {
    fail(op, ": dtype must be f32 or bf16 on cuda, got ", dtype_name(t));
  }
}

// Thread index and stride of a grid-stride loop over [0, n).
__device__ __forceinline__ int64_t grid_start() {
  return blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return int64_t{blockDim.x} * gridDim.x;
}

// The sum (or max) of every thread's v over the block, returned to every thread. blockDim.x must
// be a multiple of 32 and every thread of the block must call it. The warps' partial results are
// combined in warp order by each thread, so the result is the same in every thread and every run.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T warp_part[32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // an earlier call's readers are done with warp_part
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = v;
  __syncthreads();
  T total = warp_part[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w) total += warp_part[w];
  return total;
}

__device__ inline float block_max(float v) {
  __shared__ float warp_part[32];
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = v;
  __syncthreads();
  float total = warp_part[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w) total = fmaxf(total, warp_part[w]);
  return total;
}

// A row of v logits' maximum and the sum of exp(logit - maximum), both returned to every
// thread; every thread of the block must call it (one block per row).
struct RowExpSum {
  float max, sum;
};
__device__ inline RowExpSum row_exp_sum(const float* row, int64_t v) {
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_max(mx);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) sum += expf(row[j] - mx);
  return {mx, block_sum(sum)};
}

}  // namespace pollen::ops::cuda
