#include "ops/adamw.h"

#include <algorithm>
#include <cmath>

#include "base/thread_pool.h"
#include "ops/check.h"
#include "ops/cuda/kernels.h"
#include "ops/profile.h"

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

#if POLLEN_HAVE_CUDA
void adamw_step_cuda(std::vector<AdamWSlot>& slots, const AdamWHyper& h) {
  const float* device_scale = nullptr;
  if (h.device_clip.defined()) {
    expect("adamw", "device_clip", h.device_clip, {2}, DType::f32, Device::cuda);
    device_scale = h.device_clip.data<float>() + 1;
  }
  for (const AdamWSlot& s : slots) {
    const Shape& shape = s.param.shape();
    expect("adamw", "param", s.param, shape, DType::f32, Device::cuda);
    POLLEN_CHECK(
        s.grad.defined() && (s.grad.dtype() == DType::f32 || s.grad.dtype() == DType::bf16),
        "adamw: grad must be f32 or bf16 on cuda");
    expect("adamw", "grad", s.grad, shape, s.grad.dtype(), Device::cuda);
    expect("adamw", "exp_avg", s.exp_avg, shape, DType::f32, Device::cuda);
    expect("adamw", "exp_avg_sq", s.exp_avg_sq, shape, DType::f32, Device::cuda);
    if (s.model_copy.defined())
      expect("adamw", "model_copy", s.model_copy, shape, DType::bf16, Device::cuda);
  }
  // The constants as adamw_range<float> computes them.
  cuda::AdamWArgs a;
  a.beta1 = static_cast<float>(h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.step_size = static_cast<float>(h.lr / (1.0 - std::pow(h.beta1, static_cast<double>(h.step))));
  a.inv_sqrt_bias_correction2 =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step))));
  a.eps = static_cast<float>(h.eps);
  a.grad_scale = static_cast<float>(h.grad_scale);
  std::vector<cuda::AdamWTensor> tensors;
  for (const AdamWSlot& s : slots) {
    tensors.push_back(
        {s.param.data<float>(), s.grad.raw(), s.exp_avg.data<float>(), s.exp_avg_sq.data<float>(),
         s.model_copy.defined() ? s.model_copy.raw() : nullptr, s.param.numel(),
         static_cast<float>(1.0 - h.lr * s.weight_decay), s.grad.dtype() == DType::bf16});
  }
  cuda::adamw(tensors.data(), static_cast<int64_t>(tensors.size()), a, device_scale);
}

// total (1) f64 on the GPU += the sums of squares of the tensors (on the GPU).
void sum_of_squares_cuda(const std::vector<Tensor>& tensors, Tensor& total) {
  Tensor partials = Tensor::empty({cuda::kSumOfSquaresBlocks}, DType::f64, Device::cuda);
  std::vector<Tensor> contiguous;  // keeps the copies of non-contiguous tensors alive
  std::vector<cuda::SquaresTensor> list;
  for (const Tensor& t : tensors) {
    POLLEN_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16,
                 "sum_of_squares: tensors on cuda must be f32 or bf16, got ",
                 dtype_name(t.dtype()));
    contiguous.push_back(t.contiguous());
    list.push_back({contiguous.back().raw(), t.numel(), t.dtype() == DType::bf16});
  }
  cuda::sum_of_squares_accumulate(list.data(), static_cast<int64_t>(list.size()),
                                  partials.data<double>(), total.data<double>());
}
#endif

}  // namespace

void adamw_step(std::vector<AdamWSlot>& slots, const AdamWHyper& hyper) {
  const OpTimer timer("adamw", slots.empty() ? Tensor() : slots.front().param);
#if POLLEN_HAVE_CUDA
  if (!slots.empty() && slots[0].param.defined() && slots[0].param.device() == Device::cuda)
    return adamw_step_cuda(slots, hyper);
#endif
  POLLEN_CHECK(!hyper.device_clip.defined(), "adamw: device_clip is for parameters on cuda");
  // One parallel pass over the concatenation of all parameters.
  std::vector<int64_t> starts(slots.size() + 1, 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& s = slots[i];
    const DType dt = s.param.dtype();
    expect("adamw", "param", s.param, s.param.shape(), dt);
    expect("adamw", "grad", s.grad, s.param.shape(), dt);
    expect("adamw", "exp_avg", s.exp_avg, s.param.shape(), dt);
    expect("adamw", "exp_avg_sq", s.exp_avg_sq, s.param.shape(), dt);
    POLLEN_CHECK(!s.model_copy.defined(), "adamw: model_copy is for parameters on cuda");
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
  const OpTimer timer("grad_norm", tensors.empty() ? Tensor() : tensors.front());
  double total = 0;
#if POLLEN_HAVE_CUDA
  std::vector<Tensor> on_gpu;
  for (const Tensor& t : tensors)
    if (t.device() == Device::cuda) on_gpu.push_back(t);
  if (!on_gpu.empty()) {
    Tensor gpu_total = Tensor::zeros({1}, DType::f64, Device::cuda);
    sum_of_squares_cuda(on_gpu, gpu_total);
    total += gpu_total.item();
  }
#endif
  // One parallel pass over the concatenation of the tensors on the CPU: a launch of the pool per
  // tensor cost more than the reading for a model's many small ones.
  std::vector<Tensor> on_cpu;
  std::vector<int64_t> starts{0};
  for (const Tensor& t : tensors) {
    if (t.device() != Device::cpu) continue;
    on_cpu.push_back(t.contiguous());
    starts.push_back(starts.back() + t.numel());
  }
  // The sum is cut into fixed blocks, each summed on its own and the blocks added in order, so
  // that it is the same bitwise on any number of threads: data-parallel ranks with different
  // thread counts clip by the same norm and keep the same weights.
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t n = starts.back();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int chunks =
      static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, blocks)));
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  pool().run_chunks(blocks, chunks, [&](int64_t first_block, int64_t end_block, int) {
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t lo = block * kBlock;
      const int64_t hi = std::min(n, lo + kBlock);
      // Eight independent lanes, added in a fixed order: vectorised and deterministic.
      double lane[8] = {};
      size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) -
                                     starts.begin() - 1);
      for (; i < on_cpu.size() && starts[i] < hi; ++i) {
        const int64_t b = std::max(lo, starts[i]) - starts[i];
        const int64_t e = std::min(hi, starts[i + 1]) - starts[i];
        dispatch_float("sum_of_squares", on_cpu[i].dtype(), [&]<typename T>(T) {
          const T* p = on_cpu[i].data<T>();
          int64_t j = b;
          for (; j + 8 <= e; j += 8)
            for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(p[j + l]) * p[j + l];
          for (; j < e; ++j) lane[0] += static_cast<double>(p[j]) * p[j];
        });
      }
      double acc = 0;
      for (double x : lane) acc += x;
      partial[static_cast<size_t>(block)] = acc;
    }
  });
  for (double x : partial) total += x;
  return total;
}

Tensor clip_factor(const std::vector<Tensor>& grads, double max_norm) {
  const OpTimer timer("grad_norm", grads.empty() ? Tensor() : grads.front());
#if POLLEN_HAVE_CUDA
  for (const Tensor& g : grads)
    POLLEN_CHECK(g.defined() && g.device() == Device::cuda,
                 "clip_factor: every gradient must be on cuda");
  Tensor total = Tensor::zeros({1}, DType::f64, Device::cuda);
  sum_of_squares_cuda(grads, total);
  Tensor out = Tensor::empty({2}, DType::f32, Device::cuda);
  cuda::clip_factor(total.data<double>(), max_norm, out.data<float>());
  return out;
#else
  fail("clip_factor: the gradients must be on cuda, and this pollen was built without CUDA");
#endif
}

}  // namespace pollen::ops
