#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "base/thread_pool.h"
#include "ops/check.h"
#include "ops/cpu/fast_exp.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/weight_grad_sum.h"
#include "ops/per_sample.h"
#include "ops/profile.h"

namespace pollen::ops {
namespace {

template <typename T>
T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return cpu::fast_exp(x);
  } else {
    return std::exp(x);
  }
}

// Row reductions with kLanes independent partial results combined in a fixed order: the
// compiler vectorises them (no reassociation needed) and the result never depends on threads.
constexpr int64_t kLanes = 16;

template <typename T>
T row_max(const T* row, int64_t v) {
  T lane[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lane[l] = row[0];
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], row[j + l]);
  T mx = lane[0];
  for (int64_t l = 1; l < kLanes; ++l) mx = std::max(mx, lane[l]);
  for (; j < v; ++j) mx = std::max(mx, row[j]);
  return mx;
}

// Replaces row[j] by exp(row[j] - mx) and returns their sum.
template <typename T>
T exp_in_place_sum(T* row, int64_t v, T mx) {
  T lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      row[j + l] = exp_of<T>(row[j + l] - mx);
      lane[l] += row[j + l];
    }
  }
  T sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lane[l];
  for (; j < v; ++j) {
    row[j] = exp_of<T>(row[j] - mx);
    sum += row[j];
  }
  return sum;
}

// One block of rows: logits (nb,V) -> per-row loss; when want_grad, the logits are replaced by
// their gradient grad_scale * row_scale[i] * (softmax - onehot(target)) (zero for unscored rows
// and rows of scale 0; row_scale null: 1).
template <typename T>
void softmax_rows(T* logits, const int32_t* targets, int64_t nb, int64_t v, double* row_loss,
                  bool want_grad, T grad_scale, const double* row_scale = nullptr) {
  parallel_for(nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T* row = logits + i * v;
      const int32_t t = targets[i];
      if (t < 0) {
        row_loss[i] = 0;
        if (want_grad) std::fill(row, row + v, T(0));
        continue;
      }
      const double target_logit = static_cast<double>(row[t]);
      const T mx = row_max(row, v);
      const T sum = exp_in_place_sum(row, v, mx);
      row_loss[i] = static_cast<double>(mx) + std::log(static_cast<double>(sum)) - target_logit;
      if (want_grad) {
        const T scale = row_scale ? grad_scale * static_cast<T>(row_scale[i]) : grad_scale;
        if (scale == T(0)) {
          std::fill(row, row + v, T(0));
          continue;
        }
        const T inv = scale / sum;
        for (int64_t j = 0; j < v; ++j) row[j] *= inv;
        row[t] -= scale;
      }
    }
  });
}

#if POLLEN_HAVE_CUDA
// The GPU version of the block loop: logits (block_rows,V) in fp32 from a GEMM that accumulates
// in fp32 (bf16 h and w, or f32), softmax and loss per row on the GPU, and for bf16 the gradient
// rounded to bf16 for the two gradient GEMMs; dw sums the blocks in fp32 (WeightGradSum). Row
// losses come back to the host once, at the end.
void cross_entropy_cuda(const Tensor& h, const Tensor& w, const Tensor& targets,
                        CrossEntropyGrads* grads, int64_t block_rows, double* row_loss) {
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const DType dt = h.dtype();
  const size_t row_bytes = static_cast<size_t>(c) * dtype_size(dt);
  Tensor logits = Tensor::empty({block_rows, v}, DType::f32, Device::cuda);
  Tensor logits_bf16;
  if (grads && dt == DType::bf16) logits_bf16 = Tensor::empty({block_rows, v}, dt, Device::cuda);
  Tensor losses = Tensor::empty({n}, DType::f64, Device::cuda);
  std::optional<cuda::WeightGradSum> dw_sum;
  if (grads && grads->dw.defined()) dw_sum.emplace(grads->dw, (n + block_rows - 1) / block_rows);
  for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
    const int64_t nb = std::min(block_rows, n - r0);
    const void* hb = static_cast<const char*>(h.raw()) + static_cast<size_t>(r0) * row_bytes;
    // (nb,V) = hb w^T
    cuda::gemm(dt, hb, false, w.raw(), true, DType::f32, logits.raw(), nb, v, c, 1.0, 0.0);
    // the gradient over the logits, or straight into logits_bf16 for bf16's GEMMs
    cuda::softmax_cross_entropy_rows(logits.data<float>(), targets.data<int32_t>() + r0, nb, v,
                                     losses.data<double>() + r0, grads != nullptr,
                                     static_cast<float>(grads ? grads->grad_scale : 1.0),
                                     logits_bf16.defined() ? logits_bf16.raw() : nullptr);
    if (grads) {
      const void* g = logits_bf16.defined() ? logits_bf16.raw() : logits.raw();
      // dh (nb,C) = g (nb,V) @ w (V,C);  dw (V,C) += g^T (V,nb) @ hb (nb,C); either may be left
      // out (undefined), as on the CPU
      if (grads->dh.defined()) {
        void* dhb = static_cast<char*>(grads->dh.raw()) + static_cast<size_t>(r0) * row_bytes;
        cuda::gemm(dt, g, false, w.raw(), false, dt, dhb, nb, c, v, 1.0, 0.0);
      }
      if (dw_sum) dw_sum->add(dt, g, hb, nb);
    }
  }
  if (dw_sum) dw_sum->finish();
  const std::vector<double> host = losses.to_doubles();
  std::copy(host.begin(), host.end(), row_loss);
}
#endif

}  // namespace

int64_t cross_entropy_default_block_rows(int64_t vocab, Device device) {
  vocab = std::max<int64_t>(vocab, 1);
  // On the GPU every block costs a dw GEMM that reads and writes all of dw (V,C): the CPU's ~4 M
  // logits per block would make that hundreds of skinny GEMMs per batch (32 rows each for
  // V = 128 K). So 2^28 logits per block (1 GiB of fp32 logits, plus 0.5 GiB for bf16's copy of
  // the gradient), and at least 256 rows so that the GEMMs stay wide for any vocabulary (above
  // V = 2^20 that is more than 1 GiB). The caller caps the rows at N.
  if (device == Device::cuda) return std::max<int64_t>(256, (int64_t{1} << 28) / vocab);
  return std::max<int64_t>(16, (int64_t{1} << 22) / vocab);
}

double cross_entropy_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                             int64_t* scored, CrossEntropyGrads* grads, int64_t block_rows) {
  const OpTimer timer("cross_entropy", h);
  const int64_t v = w.size(0), c = w.size(1), n = targets.numel();
  const DType dt = h.dtype();
  const Device dev = h.device();
  expect("cross_entropy", "h", h, {n, c}, dt, dev);
  expect("cross_entropy", "w", w, {v, c}, dt, dev);
  expect("cross_entropy", "targets", targets, {n}, DType::i32, dev);
  const Tensor host_targets = targets.cpu();
  const int32_t* tg = host_targets.data<int32_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    POLLEN_CHECK(tg[i] < v, "cross_entropy: target ", tg[i], " at row ", i,
                 " is outside the vocabulary [0, ", v, ")");
    count += tg[i] >= 0;
  }
  *scored = count;
  const int64_t sample_rows = grads ? grads->sample_rows : 0;
  if (grads) {
    if (grads->dh.defined()) expect("cross_entropy", "dh", grads->dh, {n, c}, dt, dev);
    if (grads->dw.defined()) expect("cross_entropy", "dw", grads->dw, {v, c}, dt, dev);
    if (sample_rows > 0) {
      POLLEN_CHECK(dev == Device::cpu && dt == DType::f32 && n % sample_rows == 0,
                   "cross_entropy: per-sample clipping runs in float32 on the CPU over whole ",
                   "samples; got ", n, " rows for samples of ", sample_rows);
      const size_t samples = static_cast<size_t>(n / sample_rows);
      if (grads->sample_tied_rows.defined()) {
        POLLEN_CHECK(grads->sample_input_ids, "cross_entropy: the tied rows need the input ids");
        expect("cross_entropy", "sample_tied_rows", grads->sample_tied_rows, {n, c}, dt, dev);
      }
      POLLEN_CHECK((!grads->sample_norms_sq || grads->sample_norms_sq->size() == samples) &&
                       (!grads->sample_scale || grads->sample_scale->size() == samples),
                   "cross_entropy: expected one norm and one scale per sample (", samples, ")");
    }
  }
  if (block_rows <= 0) block_rows = cross_entropy_default_block_rows(v, dev);
  block_rows = std::min(block_rows, std::max<int64_t>(n, 1));
  // Per-sample clipping: blocks of whole samples, so that a sample's norm comes from one block.
  if (sample_rows > 0) block_rows = std::max<int64_t>(1, block_rows / sample_rows) * sample_rows;

  std::vector<double> row_loss(static_cast<size_t>(n));
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) {
    cross_entropy_cuda(h, w, targets, grads, block_rows, row_loss.data());
    double total = 0;
    for (double l : row_loss) total += l;
    return total;
  }
#endif
  dispatch_float("cross_entropy", dt, [&]<typename T>(T) {
    Tensor logits = Tensor::empty({block_rows, v}, dt);
    std::vector<double> row_scale;  // per-sample clipping's scales, by row
    for (int64_t r0 = 0; r0 < n; r0 += block_rows) {
      const int64_t nb = std::min(block_rows, n - r0);
      const T* hb = h.data<T>() + r0 * c;
      T* lg = logits.data<T>();
      cpu::gemm<T>(hb, false, w.data<T>(), true, lg, nb, v, c, T(1), T(0));  // (nb,V) = hb w^T
      if (grads && grads->sample_scale) {
        row_scale.resize(static_cast<size_t>(nb));
        for (int64_t i = 0; i < nb; ++i)
          row_scale[static_cast<size_t>(i)] =
              (*grads->sample_scale)[static_cast<size_t>((r0 + i) / sample_rows)];
      }
      softmax_rows<T>(lg, tg + r0, nb, v, row_loss.data() + r0, grads != nullptr,
                      static_cast<T>(grads ? grads->grad_scale : 1.0),
                      row_scale.empty() ? nullptr : row_scale.data());
      if (grads && grads->sample_norms_sq) {
        if constexpr (std::is_same_v<T, float>) {
          for (int64_t i = 0; i < nb; i += sample_rows)  // a sample's dw: g_s^T (V,rows) @ h_s
            (*grads->sample_norms_sq)[static_cast<size_t>((r0 + i) / sample_rows)] +=
                outer_product_norm_sq(lg + i * v, v, hb + i * c, c, sample_rows);
          if (grads->sample_tied_rows.defined()) {
            // Per sample: gather (rows,rows) [r][t] = g[r, id_t], then out (rows,C) = gather^T h.
            std::vector<float> gather(static_cast<size_t>(sample_rows * sample_rows));
            for (int64_t i = 0; i < nb; i += sample_rows) {
              const int32_t* ids = grads->sample_input_ids + r0 + i;
              for (int64_t r = 0; r < sample_rows; ++r)
                for (int64_t t = 0; t < sample_rows; ++t)
                  gather[static_cast<size_t>(r * sample_rows + t)] = lg[(i + r) * v + ids[t]];
              cpu::gemm<float>(gather.data(), true, hb + i * c, false,
                               grads->sample_tied_rows.data<float>() + (r0 + i) * c, sample_rows, c,
                               sample_rows, 1.0f, 0.0f);
            }
          }
        }
      }
      if (grads) {
        // dh (nb,C) = g (nb,V) @ w (V,C);  dw (V,C) += g^T (V,nb) @ hb (nb,C)
        if (grads->dh.defined())
          cpu::gemm<T>(lg, false, w.data<T>(), false, grads->dh.data<T>() + r0 * c, nb, c, v, T(1),
                       T(0));
        if (grads->dw.defined())
          cpu::gemm<T>(lg, true, hb, false, grads->dw.data<T>(), v, c, nb, T(1), T(1));
      }
    }
  });
  double total = 0;
  for (double l : row_loss) total += l;
  return total;
}

}  // namespace pollen::ops
