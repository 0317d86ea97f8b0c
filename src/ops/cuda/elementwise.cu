// Elementwise kernels: residual add, product, axpy, scaling, SwiGLU (fp32 math).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace pollen::ops::cuda {
namespace {

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) store(out, i, load(a, i) + load(b, i));
}

template <typename T>
__global__ void mul_kernel(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) store(out, i, load(a, i) * load(b, i));
}

template <typename T>
__global__ void axpy_kernel(float alpha, const T* x, T* y, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride())
    store(y, i, load(y, i) + alpha * load(x, i));
}

template <typename T>
__global__ void scale_kernel(float alpha, const T* x, T* y, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) store(y, i, alpha * load(x, i));
}

// out = silu(g) * up, silu(g) = g * sigmoid(g).
template <typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float g = load(gate, i);
    const float sig = 1.0f / (1.0f + expf(-g));
    store(out, i, g * sig * load(up, i));
  }
}

// d gate = dout * up * sig * (1 + g * (1 - sig)),  d up = dout * silu(g).
template <typename T>
__global__ void swiglu_backward_kernel(const T* dout, const T* gate, const T* up, T* dgate, T* dup,
                                       int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float g = load(gate, i), d = load(dout, i);
    const float sig = 1.0f / (1.0f + expf(-g));
    store(dgate, i, d * load(up, i) * sig * (1.0f + g * (1.0f - sig)));
    store(dup, i, d * g * sig);
  }
}

}  // namespace

void add(DType t, const void* a, const void* b, void* out, int64_t n) {
  dispatch("add", t, [&](auto tag) {
    using T = decltype(tag);
    add_kernel<T><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
    POLLEN_CUDA_CHECK_LAUNCH("add", "n=", n);
  });
}

void mul(DType t, const void* a, const void* b, void* out, int64_t n) {
  dispatch("mul", t, [&](auto tag) {
    using T = decltype(tag);
    mul_kernel<T><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
    POLLEN_CUDA_CHECK_LAUNCH("mul", "n=", n);
  });
}

void axpy(DType t, double alpha, const void* x, void* y, int64_t n) {
  dispatch("axpy", t, [&](auto tag) {
    using T = decltype(tag);
    axpy_kernel<T><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<float>(alpha), static_cast<const T*>(x), static_cast<T*>(y), n);
    POLLEN_CUDA_CHECK_LAUNCH("axpy", "n=", n, " alpha=", alpha);
  });
}

void scale_into(DType t, double alpha, const void* x, void* y, int64_t n) {
  dispatch("scale_into", t, [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<float>(alpha), static_cast<const T*>(x), static_cast<T*>(y), n);
    POLLEN_CUDA_CHECK_LAUNCH("scale_into", "n=", n, " alpha=", alpha);
  });
}

void swiglu_forward(DType t, const void* gate, const void* up, void* out, int64_t n) {
  dispatch("swiglu", t, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n);
    POLLEN_CUDA_CHECK_LAUNCH("swiglu_forward", "n=", n);
  });
}

void swiglu_backward(DType t, const void* dout, const void* gate, const void* up, void* dgate,
                     void* dup, int64_t n) {
  dispatch("swiglu_backward", t, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
        static_cast<const T*>(dout), static_cast<const T*>(gate), static_cast<const T*>(up),
        static_cast<T*>(dgate), static_cast<T*>(dup), n);
    POLLEN_CUDA_CHECK_LAUNCH("swiglu_backward", "n=", n);
  });
}

}  // namespace pollen::ops::cuda
