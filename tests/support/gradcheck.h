#pragma once
// Gradient checking in float64: autograd's gradient of a scalar function of some leaves against
// central finite differences, element by element.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "autograd/functions.h"
#include "base/rng.h"

namespace pollen::testing {

inline Tensor random_tensor(const Shape& shape, Rng& rng, double scale = 1.0,
                            DType dtype = DType::f64) {
  Tensor t = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = scale * rng.normal();
  return dtype == DType::f64 ? t : t.to(dtype);
}

// Checks d f / d leaves. f builds a scalar from the leaves (it is called many times).
// Returns the largest relative error seen: |analytic - numeric| / max(1, |numeric|)... per
// element, scaled by the largest gradient magnitude of that leaf.
inline double max_gradcheck_error(const std::function<ag::Var(std::vector<ag::Var>&)>& f,
                                  std::vector<ag::Var>& leaves, double step = 1e-6) {
  for (auto& l : leaves) l.zero_grad();
  ag::Tape tape;
  ag::Var out;
  {
    ag::TapeScope scope(tape);
    out = f(leaves);
  }
  tape.backward(out);
  double worst = 0;
  for (auto& leaf : leaves) {
    if (!leaf.requires_grad()) continue;
    EXPECT_TRUE(leaf.grad().defined()) << "no gradient reached leaf " << leaf.name();
    if (!leaf.grad().defined()) continue;
    const std::vector<double> analytic = leaf.grad().to_doubles();
    double* x = leaf.value().data<double>();
    double scale = 1e-3;
    std::vector<double> numeric(analytic.size());
    for (size_t i = 0; i < analytic.size(); ++i) {
      const double saved = x[i];
      ag::NoGrad no_grad;
      x[i] = saved + step;
      const double plus = f(leaves).value().item();
      x[i] = saved - step;
      const double minus = f(leaves).value().item();
      x[i] = saved;
      numeric[i] = (plus - minus) / (2 * step);
      scale = std::max(scale, std::fabs(numeric[i]));
    }
    for (size_t i = 0; i < analytic.size(); ++i) {
      const double err = std::fabs(analytic[i] - numeric[i]) / scale;
      EXPECT_LT(err, 1e-5) << "leaf " << leaf.name() << " element " << i << ": autograd "
                           << analytic[i] << ", finite differences " << numeric[i];
      worst = std::max(worst, err);
    }
  }
  return worst;
}

// sum(y * weights): a scalar whose gradient w.r.t. y is `weights`, so every output element
// matters and a wrong element of the backward pass cannot cancel out.
inline ag::Var weighted_sum(const ag::Var& y, const Tensor& weights) {
  // Implemented as a cross-entropy-free contraction: a linear map to one output.
  const int64_t n = y.value().numel();
  ag::Var flat = ag::reshape(y, {1, n});
  ag::Var w(weights.reshape({1, n}), false, "weights");
  return ag::reshape(ag::linear(flat, w), {1});
}

}  // namespace pollen::testing
