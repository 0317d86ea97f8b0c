#include "ops/token_logprobs.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "base/thread_pool.h"
#include "ops/check.h"
#include "ops/cpu/kernels.h"
#include "ops/cross_entropy.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/weight_grad_sum.h"
#include "ops/profile.h"

namespace pollen::ops {
namespace {

// h, w and targets on one device, shapes and dtypes as documented; every target below the
// vocabulary (read on the host, from a copy for GPU targets).
void check_args(const char* op, const Tensor& h, const Tensor& w, const Tensor& targets) {
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const Device dev = h.device();
  expect(op, "h", h, {n, c}, h.dtype(), dev);
  expect(op, "w", w, {v, c}, h.dtype(), dev);
  expect(op, "targets", targets, {n}, DType::i32, dev);
  if (dev == Device::cuda)
    POLLEN_CHECK(h.dtype() == DType::f32 || h.dtype() == DType::bf16, op,
                 ": h must be f32 or bf16 on cuda, got ", dtype_name(h.dtype()));
  const Tensor host = targets.cpu();
  const int32_t* tg = host.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    POLLEN_CHECK(tg[i] < v, op, ": target ", tg[i], " at row ", i,
                 " is outside the vocabulary [0, ", v, ")");
}

void check_temperature(const char* op, double temperature) {
  POLLEN_CHECK(std::isfinite(temperature) && temperature > 0, op,
               ": temperature must be a positive number, got ", temperature);
}

int64_t rows_per_block(int64_t block_rows, int64_t v, int64_t n, Device device) {
  if (block_rows <= 0) block_rows = cross_entropy_default_block_rows(v, device);
  return std::min(block_rows, std::max<int64_t>(n, 1));
}

#if POLLEN_HAVE_CUDA
// The GPU versions of the block loops below: each block's logits (block_rows,V) in fp32 from a
// GEMM that accumulates in fp32 (bf16 or f32 h and w); for bf16 the gradient is rounded to bf16
// for the two gradient GEMMs and dw sums the blocks in fp32 (WeightGradSum), as cross-entropy
// does.
void forward_cuda(const Tensor& h, const Tensor& w, const Tensor& targets, Tensor& logp,
                  Tensor& lse, double temperature, int64_t block_rows) {
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const DType dt = h.dtype();
  const size_t row_bytes = static_cast<size_t>(c) * dtype_size(dt);
  Tensor logits = Tensor::empty({block_rows, v}, DType::f32, Device::cuda);
  for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
    const int64_t nb = std::min(block_rows, n - r0);
    const void* hb = static_cast<const char*>(h.raw()) + static_cast<size_t>(r0) * row_bytes;
    cuda::gemm(dt, hb, false, w.raw(), true, DType::f32, logits.raw(), nb, v, c, 1.0 / temperature,
               0.0);
    cuda::token_logprob_rows(logits.data<float>(), targets.data<int32_t>() + r0, nb, v,
                             logp.data<float>() + r0, lse.data<float>() + r0);
  }
}

void backward_cuda(const Tensor& dlogp, const Tensor& h, const Tensor& w, const Tensor& targets,
                   const Tensor& lse, Tensor& dh, Tensor& dw, double temperature,
                   int64_t block_rows) {
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const DType dt = h.dtype();
  const size_t row_bytes = static_cast<size_t>(c) * dtype_size(dt);
  Tensor logits = Tensor::empty({block_rows, v}, DType::f32, Device::cuda);
  Tensor logits_bf16;
  if (dt == DType::bf16) logits_bf16 = Tensor::empty({block_rows, v}, dt, Device::cuda);
  std::optional<cuda::WeightGradSum> dw_sum;
  if (dw.defined()) dw_sum.emplace(dw, (n + block_rows - 1) / block_rows);
  for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
    const int64_t nb = std::min(block_rows, n - r0);
    const void* hb = static_cast<const char*>(h.raw()) + static_cast<size_t>(r0) * row_bytes;
    cuda::gemm(dt, hb, false, w.raw(), true, DType::f32, logits.raw(), nb, v, c, 1.0 / temperature,
               0.0);
    // the gradient over the unscaled logits (1/T through the scaling), or straight into
    // logits_bf16 for bf16's GEMMs
    cuda::token_logprob_grad_rows(logits.data<float>(), targets.data<int32_t>() + r0,
                                  dlogp.data<float>() + r0, lse.data<float>() + r0, nb, v,
                                  static_cast<float>(1.0 / temperature),
                                  logits_bf16.defined() ? logits_bf16.raw() : nullptr);
    const void* g = logits_bf16.defined() ? logits_bf16.raw() : logits.raw();
    void* dhb = static_cast<char*>(dh.raw()) + static_cast<size_t>(r0) * row_bytes;
    // dh (nb,C) = g (nb,V) @ w (V,C);  dw (V,C) += g^T (V,nb) @ hb (nb,C)
    cuda::gemm(dt, g, false, w.raw(), false, dt, dhb, nb, c, v, 1.0, 0.0);
    if (dw_sum) dw_sum->add(dt, g, hb, nb);
  }
  if (dw_sum) dw_sum->finish();
}
#endif

}  // namespace

void token_logprobs_forward(const Tensor& h, const Tensor& w, const Tensor& targets, Tensor& logp,
                            Tensor& lse, double temperature, int64_t block_rows) {
  const OpTimer timer("token_logprobs_forward", h);
  const char* op = "token_logprobs";
  check_args(op, h, w, targets);
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const DType dt = h.dtype();
  expect(op, "logp", logp, {n}, statistics_dtype(h), h.device());
  expect(op, "lse", lse, {n}, statistics_dtype(h), h.device());
  check_temperature(op, temperature);
  block_rows = rows_per_block(block_rows, v, n, h.device());
#if POLLEN_HAVE_CUDA
  if (h.device() == Device::cuda)
    return forward_cuda(h, w, targets, logp, lse, temperature, block_rows);
#endif
  const int32_t* tg = targets.data<int32_t>();
  dispatch_float(op, dt, [&]<typename T>(T) {
    Tensor logits = Tensor::empty({block_rows, v}, dt);
    for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
      const int64_t nb = std::min(block_rows, n - r0);
      T* lg = logits.data<T>();
      cpu::gemm<T>(h.data<T>() + r0 * c, false, w.data<T>(), true, lg, nb, v, c,
                   static_cast<T>(1.0 / temperature), T(0));
      parallel_for(nb, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const T* row = lg + i * v;
          const double mx = static_cast<double>(*std::max_element(row, row + v));
          double sum = 0;
          for (int64_t j = 0; j < v; ++j) sum += std::exp(static_cast<double>(row[j]) - mx);
          const double row_lse = mx + std::log(sum);
          const int32_t t = tg[r0 + i];
          lse.data<T>()[r0 + i] = static_cast<T>(row_lse);
          logp.data<T>()[r0 + i] = t < 0 ? T(0) : static_cast<T>(row[t] - row_lse);
        }
      });
    }
  });
}

void token_logprobs_backward(const Tensor& dlogp, const Tensor& h, const Tensor& w,
                             const Tensor& targets, const Tensor& lse, Tensor& dh, Tensor& dw,
                             double temperature, int64_t block_rows) {
  const OpTimer timer("token_logprobs_backward", h);
  const char* op = "token_logprobs backward";
  check_args(op, h, w, targets);
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const DType dt = h.dtype();
  const Device dev = h.device();
  expect(op, "dlogp", dlogp, {n}, statistics_dtype(h), dev);
  expect(op, "lse", lse, {n}, statistics_dtype(h), dev);
  expect(op, "dh", dh, {n, c}, dt, dev);
  if (dw.defined()) expect(op, "dw", dw, {v, c}, dt, dev);
  check_temperature(op, temperature);
  block_rows = rows_per_block(block_rows, v, n, dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda)
    return backward_cuda(dlogp, h, w, targets, lse, dh, dw, temperature, block_rows);
#endif
  const int32_t* tg = targets.data<int32_t>();
  dispatch_float(op, dt, [&]<typename T>(T) {
    Tensor logits = Tensor::empty({block_rows, v}, dt);
    for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
      const int64_t nb = std::min(block_rows, n - r0);
      const T* hb = h.data<T>() + r0 * c;
      T* lg = logits.data<T>();
      cpu::gemm<T>(hb, false, w.data<T>(), true, lg, nb, v, c, static_cast<T>(1.0 / temperature),
                   T(0));
      // Each row of logits becomes its gradient g * (onehot(target) - softmax), g = dlogp / T
      // (through the logits' scaling).
      parallel_for(nb, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          T* row = lg + i * v;
          const int32_t t = tg[r0 + i];
          const T g = t < 0 ? T(0) : static_cast<T>(dlogp.data<T>()[r0 + i] / temperature);
          const T row_lse = lse.data<T>()[r0 + i];
          for (int64_t j = 0; j < v; ++j) row[j] = -g * std::exp(row[j] - row_lse);
          if (t >= 0) row[t] += g;
        }
      });
      // dh (nb,C) = g (nb,V) @ w (V,C);  dw (V,C) += g^T (V,nb) @ hb (nb,C)
      cpu::gemm<T>(lg, false, w.data<T>(), false, dh.data<T>() + r0 * c, nb, c, v, T(1), T(0));
      if (dw.defined()) cpu::gemm<T>(lg, true, hb, false, dw.data<T>(), v, c, nb, T(1), T(1));
    }
  });
}

}  // namespace pollen::ops
