#include "ops/per_sample.h"

#include <algorithm>
#include <numeric>

#include "base/error.h"
#include "base/thread_pool.h"
#include "ops/check.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops {
namespace {

double sum_of_squares(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

void expect_samples(const char* what, const Tensor& t, int64_t rows) {
  POLLEN_CHECK(t.device() == Device::cpu && t.dtype() == DType::f32 && t.is_contiguous(),
               "per-sample clipping: ", what, " must be a contiguous float32 CPU tensor");
  POLLEN_CHECK(rows > 0 && t.size(0) % rows == 0, "per-sample clipping: ", what, "'s ", t.size(0),
               " rows are not whole samples of ", rows);
}

}  // namespace

double outer_product_norm_sq(const float* a, int64_t m, const float* b, int64_t k, int64_t t) {
  if (t * (m + k) < m * k) {
    // sum_{i,j} (a_i . a_j)(b_i . b_j)
    std::vector<float> ga(static_cast<size_t>(t * t)), gb(static_cast<size_t>(t * t));
    cpu::gemm<float>(a, false, a, true, ga.data(), t, t, m, 1.0f, 0.0f);
    cpu::gemm<float>(b, false, b, true, gb.data(), t, t, k, 1.0f, 0.0f);
    double s = 0;
    for (size_t i = 0; i < ga.size(); ++i) s += static_cast<double>(ga[i]) * gb[i];
    return std::max(s, 0.0);  // a norm near 0 may round below it
  }
  std::vector<float> outer(static_cast<size_t>(m * k));
  cpu::gemm<float>(a, true, b, false, outer.data(), m, k, t, 1.0f, 0.0f);
  return sum_of_squares(outer.data(), m * k);
}

std::vector<double> sample_outer_norms_sq(const Tensor& dy, const Tensor& x, int64_t rows) {
  expect_samples("dy", dy, rows);
  expect_samples("x", x, rows);
  POLLEN_CHECK(dy.size(0) == x.size(0), "per-sample clipping: dy has ", dy.size(0), " rows, x has ",
               x.size(0));
  const int64_t m = dy.numel() / dy.size(0), k = x.numel() / x.size(0);
  std::vector<double> norms(static_cast<size_t>(dy.size(0) / rows));
  for (size_t s = 0; s < norms.size(); ++s) {
    const int64_t r0 = static_cast<int64_t>(s) * rows;
    norms[s] =
        outer_product_norm_sq(dy.data<float>() + r0 * m, m, x.data<float>() + r0 * k, k, rows);
  }
  return norms;
}

std::vector<double> tied_cross_terms(const Tensor& tied, const Tensor& dx, int64_t rows) {
  expect_samples("tied head rows", tied, rows);
  expect_samples("embedding gradient", dx, rows);
  POLLEN_CHECK(tied.shape() == dx.shape(), "per-sample clipping: the tied head's rows ",
               shape_str(tied.shape()), " and the embedding's gradient ", shape_str(dx.shape()),
               " disagree");
  const int64_t per_sample = rows * dx.size(1);
  std::vector<double> cross(static_cast<size_t>(dx.size(0) / rows));
  parallel_for(static_cast<int64_t>(cross.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const float* a = tied.data<float>() + s * per_sample;
      const float* b = dx.data<float>() + s * per_sample;
      double sum = 0;
      for (int64_t i = 0; i < per_sample; ++i) sum += static_cast<double>(a[i]) * b[i];
      cross[static_cast<size_t>(s)] = sum;
    }
  });
  return cross;
}

Tensor scale_samples(const Tensor& g, int64_t rows, const std::vector<double>& scale) {
  expect_samples("gradient", g, rows);
  const int64_t per_sample = rows * (g.numel() / g.size(0));
  POLLEN_CHECK(static_cast<int64_t>(scale.size()) * rows == g.size(0),
               "per-sample clipping: ", scale.size(), " scales for ", g.size(0) / rows, " samples");
  Tensor out = Tensor::empty(g.shape(), DType::f32);
  parallel_for(static_cast<int64_t>(scale.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const float* src = g.data<float>() + s * per_sample;
      float* dst = out.data<float>() + s * per_sample;
      const float f = static_cast<float>(scale[static_cast<size_t>(s)]);
      if (f == 0.0f) {
        std::fill(dst, dst + per_sample, 0.0f);
      } else {
        for (int64_t i = 0; i < per_sample; ++i) dst[i] = f * src[i];
      }
    }
  });
  return out;
}

Tensor without_left_out(const Tensor& x, int64_t rows, const std::vector<double>& scale) {
  if (std::find(scale.begin(), scale.end(), 0.0) == scale.end()) return x;
  std::vector<double> keep(scale.size());
  for (size_t s = 0; s < scale.size(); ++s) keep[s] = scale[s] != 0 ? 1.0 : 0.0;
  return scale_samples(x, rows, keep);
}

double SparseRows::norm_sq() const {
  return sum_of_squares(sums.data(), static_cast<int64_t>(sums.size()));
}

std::vector<SparseRows> embedding_sample_grads(const Tensor& dout, const Tensor& ids,
                                               int64_t rows) {
  expect_samples("embedding gradient", dout, rows);
  POLLEN_CHECK(ids.dtype() == DType::i32 && ids.numel() == dout.size(0),
               "per-sample clipping: expected one int32 id per embedding gradient row");
  const Tensor host_ids = ids.cpu().contiguous();
  const int64_t c = dout.size(1);
  std::vector<SparseRows> grads(static_cast<size_t>(dout.size(0) / rows));
  parallel_for(static_cast<int64_t>(grads.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const int32_t* id = host_ids.data<int32_t>() + s * rows;
      const float* g = dout.data<float>() + s * rows * c;
      std::vector<int64_t> order(static_cast<size_t>(rows));
      std::iota(order.begin(), order.end(), 0);
      // By id, and by position within an id: each id's rows are summed in token order.
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return id[a] < id[b]; });
      SparseRows& out = grads[static_cast<size_t>(s)];
      for (int64_t r : order) {
        if (out.ids.empty() || out.ids.back() != id[r]) {
          out.ids.push_back(id[r]);
          out.sums.resize(out.sums.size() + static_cast<size_t>(c), 0.0f);
        }
        float* sum = out.sums.data() + out.sums.size() - static_cast<size_t>(c);
        for (int64_t j = 0; j < c; ++j) sum[j] += g[r * c + j];
      }
    }
  });
  return grads;
}

void add_scaled_sparse_rows(const std::vector<SparseRows>& grads, const std::vector<double>& scale,
                            Tensor& dtable) {
  POLLEN_CHECK(dtable.device() == Device::cpu && dtable.dtype() == DType::f32 &&
                   dtable.is_contiguous() && scale.size() == grads.size(),
               "per-sample clipping: expected a float32 CPU table and one scale per sample");
  const int64_t c = dtable.size(1);
  float* table = dtable.data<float>();
  // Samples in order: every id's row sums its samples in the same order, whatever the threads.
  for (size_t s = 0; s < grads.size(); ++s) {
    const float f = static_cast<float>(scale[s]);
    if (f == 0.0f) continue;
    for (size_t i = 0; i < grads[s].ids.size(); ++i) {
      cpu::axpy<float>(f, grads[s].sums.data() + i * static_cast<size_t>(c),
                       table + static_cast<int64_t>(grads[s].ids[i]) * c, c);
    }
  }
}

}  // namespace pollen::ops
