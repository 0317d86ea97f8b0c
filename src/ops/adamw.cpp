#include "ops/adamw.h"

#include <algorithm>
#include <cmath>

#include "base/thread_pool.h"
#include "ops/check.h"

namespace pollen::ops {
namespace {

template <typename T>
void adamw_range(const AdamWSlot& s, int64_t lo, int64_t hi, const AdamWHyper& h) {
  T* p = s.param.data<T>();
  const T* g = s.grad.data<T>();
  T* m = s.exp_avg.data<T>();
  T* v = s.exp_avg_sq.data<T>();
  const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
  const T decay = static_cast<T>(1.0 - h.lr * s.weight_decay);
  const T step_size = static_cast<T>(h.lr / (1.0 - std::pow(h.beta1, static_cast<double>(h.step))));
  const T inv_sqrt_bc2 =
      static_cast<T>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step))));
  const T eps = static_cast<T>(h.eps), scale = static_cast<T>(h.grad_scale);
  for (int64_t i = lo; i < hi; ++i) {
    const T gi = g[i] * scale;
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    const T denom = std::sqrt(v[i]) * inv_sqrt_bc2 + eps;
    p[i] = p[i] * decay - step_size * m[i] / denom;
  }
}

}  // namespace

void adamw_step(std::vector<AdamWSlot>& slots, const AdamWHyper& hyper) {
  // One parallel pass over the concatenation of all parameters.
  std::vector<int64_t> starts(slots.size() + 1, 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& s = slots[i];
    const DType dt = s.param.dtype();
    expect("adamw", "param", s.param, s.param.shape(), dt);
    expect("adamw", "grad", s.grad, s.param.shape(), dt);
    expect("adamw", "exp_avg", s.exp_avg, s.param.shape(), dt);
    expect("adamw", "exp_avg_sq", s.exp_avg_sq, s.param.shape(), dt);
    starts[i + 1] = starts[i] + s.param.numel();
  }
  parallel_for(starts.back(), 1 << 15, [&](int64_t lo, int64_t hi) {
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) -
                                   starts.begin() - 1);
    for (; i < slots.size() && starts[i] < hi; ++i) {
      const int64_t b = std::max(lo, starts[i]) - starts[i];
      const int64_t e = std::min(hi, starts[i + 1]) - starts[i];
      dispatch_float("adamw", slots[i].param.dtype(),
                     [&]<typename T>(T) { adamw_range<T>(slots[i], b, e, hyper); });
    }
  });
}

double sum_of_squares(const std::vector<Tensor>& tensors) {
  double total = 0;
  for (const Tensor& t : tensors) {
    const int64_t n = t.numel();
    const int chunks =
        static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, n / 4096)));
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    const Tensor tc = t.contiguous();
    dispatch_float("sum_of_squares", t.dtype(), [&]<typename T>(T) {
      const T* p = tc.data<T>();
      pool().run_chunks(n, chunks, [&](int64_t lo, int64_t hi, int c) {
        // Eight independent lanes, added in a fixed order: vectorised and deterministic.
        double lane[8] = {};
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8)
          for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(p[i + l]) * p[i + l];
        double acc = 0;
        for (double x : lane) acc += x;
        for (; i < hi; ++i) acc += static_cast<double>(p[i]) * p[i];
        partial[static_cast<size_t>(c)] = acc;
      });
    });
    for (double x : partial) total += x;
  }
  return total;
}

}  // namespace pollen::ops
