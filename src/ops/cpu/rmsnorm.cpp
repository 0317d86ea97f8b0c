// RMSNorm (HF LlamaRMSNorm): y = x / sqrt(mean(x^2) + eps) * w, over the last dimension C.
#include <cmath>
#include <vector>

#include "base/thread_pool.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops::cpu {
namespace {

// sum_j term(j) for j in [0, n), in Acc, over eight independent lanes added in a fixed order: the
// compiler vectorises it (one chain of adds would not be: float addition does not reassociate)
// and the result does not depend on threads.
template <typename Acc, typename Term>
Acc lane_sum(int64_t n, Term term) {
  constexpr int64_t kLanes = 8;
  Acc lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += term(j + l);
  Acc sum = 0;
  for (const Acc x : lane) sum += x;
  for (; j < n; ++j) sum += term(j);
  return sum;
}

}  // namespace

// x, y (N,C); w (C); rstd (N) saved for backward. Sums of squares in double.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, int64_t n, int64_t c, double eps) {
  parallel_for(n, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* xi = x + i * c;
      T* yi = y + i * c;
      const double ss =
          lane_sum<double>(c, [&](int64_t j) { return static_cast<double>(xi[j]) * xi[j]; });
      T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(c) + eps));
      rstd[i] = r;
      for (int64_t j = 0; j < c; ++j) yi[j] = xi[j] * r * w[j];
    }
  });
}

// With xhat = x * r:  dx = r * (dy*w - xhat * mean(dy*w*xhat)),  dw += sum_i dy * xhat.
// dw is reduced from per-chunk partial sums in chunk order: deterministic for a thread count.
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t n,
                      int64_t c, bool accumulate_dx) {
  const int chunks = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(n, 1)));
  std::vector<T> partial(static_cast<size_t>(chunks * c), T(0));
  pool().run_chunks(n, chunks, [&](int64_t lo, int64_t hi, int chunk) {
    T* dw_part = partial.data() + chunk * c;
    for (int64_t i = lo; i < hi; ++i) {
      const T* xi = x + i * c;
      const T* dyi = dy + i * c;
      T* dxi = dx + i * c;
      const T r = rstd[i];
      const T dot = lane_sum<T>(c, [&](int64_t j) { return dyi[j] * w[j] * xi[j]; });
      const T coef = dot * r * r / static_cast<T>(c);
      for (int64_t j = 0; j < c; ++j) {
        T g = r * (dyi[j] * w[j] - xi[j] * coef);
        dxi[j] = accumulate_dx ? dxi[j] + g : g;
        dw_part[j] += dyi[j] * xi[j] * r;
      }
    }
  });
  for (int k = 0; k < chunks; ++k) {
    for (int64_t j = 0; j < c; ++j) dw[j] += partial[static_cast<size_t>(k * c + j)];
  }
}

template void rmsnorm_forward<float>(const float*, const float*, float*, float*, int64_t, int64_t,
                                     double);
template void rmsnorm_forward<double>(const double*, const double*, double*, double*, int64_t,
                                      int64_t, double);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*,
                                      float*, float*, int64_t, int64_t, bool);
template void rmsnorm_backward<double>(const double*, const double*, const double*, const double*,
                                       double*, double*, int64_t, int64_t, bool);

}  // namespace pollen::ops::cpu
