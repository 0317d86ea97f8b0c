// Embedding lookup and its backward, summed per vocabulary row in token order (no atomics).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

// out[i, j] = table[ids[i], j] over the n * c elements of out.
template <typename T>
__global__ void embedding_forward_kernel(const T* table, const int32_t* ids, T* out, int64_t n,
                                         int64_t c) {
  for (int64_t e = grid_start(); e < n * c; e += grid_stride()) {
    const int64_t i = e / c, j = e % c;
    out[e] = table[static_cast<int64_t>(ids[i]) * c + j];
  }
}

// One block per distinct id: its row of dtable gains the sum of its tokens' gradient rows.
template <typename T>
__global__ void embedding_backward_kernel(const T* dout, const int32_t* rows, const int32_t* starts,
                                          const int32_t* order, T* dtable, int64_t c) {
  const int64_t r = blockIdx.x;
  const int64_t row = rows[r];
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    float sum = 0;
    for (int32_t k = starts[r]; k < starts[r + 1]; ++k)
      sum += load(dout, static_cast<int64_t>(order[k]) * c + j);
    store(dtable, row * c + j, load(dtable, row * c + j) + sum);
  }
}

}  // namespace

void embedding_forward(DType t, const void* table, const int32_t* ids, void* out, int64_t n,
                       int64_t c) {
  dispatch("embedding", t, [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_kernel<T><<<grid_blocks(n * c, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(table), ids, static_cast<T*>(out), n, c);
    POLLEN_CUDA_CHECK_LAUNCH("embedding_forward", "n=", n, " c=", c);
  });
}

void embedding_backward(DType t, const void* dout, const int32_t* rows, const int32_t* starts,
                        const int32_t* order, int64_t row_count, void* dtable, int64_t c) {
  if (row_count == 0) return;
  dispatch("embedding_backward", t, [&](auto tag) {
    using T = decltype(tag);
    embedding_backward_kernel<T>
        <<<static_cast<unsigned>(row_count), kThreads, 0, default_stream()>>>(
            static_cast<const T*>(dout), rows, starts, order, static_cast<T*>(dtable), c);
    POLLEN_CUDA_CHECK_LAUNCH("embedding_backward", "rows=", row_count, " c=", c);
  });
}

}  // namespace pollen::ops::cuda
