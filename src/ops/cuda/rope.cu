// Rotary position embedding: each thread rotates one pair (i, i + D/2) of one head of one row.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

// cos and sin are computed in f64 and rounded to f32, as the CPU's tables for f32.
template <typename T>
__global__ void rope_kernel(const T* x, const int32_t* positions, int64_t rows, int64_t heads,
                            int64_t half, const double* inv_freq, double attention_factor,
                            float sin_sign, T* out) {
  for (int64_t e = grid_start(); e < rows * heads * half; e += grid_stride()) {
    const int64_t i = e % half, row_head = e / half, row = row_head / heads;
    double s, c;
    sincos(static_cast<double>(positions[row]) * inv_freq[i], &s, &c);
    const float cf = static_cast<float>(attention_factor * c);
    const float sf = sin_sign * static_cast<float>(attention_factor * s);
    const int64_t base = row_head * 2 * half;
    const float first = load(x, base + i), second = load(x, base + i + half);
    // out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[i + D/2], x[i]).
    store(out, base + i, first * cf - second * sf);
    store(out, base + i + half, second * cf + first * sf);
  }
}

}  // namespace

void rope_rotate(DType t, const void* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, const double* inv_freq, double attention_factor, bool inverse,
                 void* out) {
  const int64_t half = head_dim / 2, pairs = rows * heads * half;
  dispatch("rope", t, [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<grid_blocks(pairs, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(x), positions, rows, heads, half, inv_freq, attention_factor,
        inverse ? -1.0f : 1.0f, static_cast<T*>(out));
    POLLEN_CUDA_CHECK_LAUNCH("rope", "rows=", rows, " heads=", heads, " head_dim=", head_dim);
  });
}

}  // namespace pollen::ops::cuda
