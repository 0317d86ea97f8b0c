// Elementwise CPU kernels: residual add, product, axpy, SwiGLU.
#include <cmath>
#include <type_traits>

#include "base/thread_pool.h"
#include "ops/cpu/fast_exp.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops::cpu {
namespace {
constexpr int64_t kGrain = 1 << 14;

// 1 / (1 + e^-g): the vectorisable exp for float, the library's for double (references).
template <typename T>
T sigmoid(T g) {
  if constexpr (std::is_same_v<T, float>) {
    return 1.0f / (1.0f + fast_exp(-g));
  } else {
    return 1.0 / (1.0 + std::exp(-g));
  }
}
}  // namespace

template <typename T>
void add(const T* a, const T* b, T* out, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

template <typename T>
void mul(const T* a, const T* b, T* out, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = a[i] * b[i];
  });
}

template <typename T>
void axpy(T alpha, const T* x, T* y, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) y[i] += alpha * x[i];
  });
}

template <typename T>
void scale_into(T alpha, const T* x, T* y, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) y[i] = alpha * x[i];
  });
}

// out = silu(gate) * up, silu(g) = g * sigmoid(g).
template <typename T>
void swiglu_forward(const T* gate, const T* up, T* out, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T g = gate[i];
      T sig = sigmoid(g);
      out[i] = g * sig * up[i];
    }
  });
}

// d gate = dout * up * sig * (1 + g * (1 - sig)),  d up = dout * silu(g).
template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T g = gate[i];
      T sig = sigmoid(g);
      T silu = g * sig;
      dgate[i] = dout[i] * up[i] * sig * (T(1) + g * (T(1) - sig));
      dup[i] = dout[i] * silu;
    }
  });
}

#define POLLEN_INSTANTIATE(T)                                       \
  template void add<T>(const T*, const T*, T*, int64_t);            \
  template void mul<T>(const T*, const T*, T*, int64_t);            \
  template void axpy<T>(T, const T*, T*, int64_t);                  \
  template void scale_into<T>(T, const T*, T*, int64_t);            \
  template void swiglu_forward<T>(const T*, const T*, T*, int64_t); \
  template void swiglu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t);
POLLEN_INSTANTIATE(float)
POLLEN_INSTANTIATE(double)
#undef POLLEN_INSTANTIATE

}  // namespace pollen::ops::cpu
