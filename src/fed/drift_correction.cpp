#include "fed/drift_correction.h"

#include "base/error.h"

namespace pollen::fed {

Weights DriftCorrection::step_drift(int64_t round, const Weights& global, int64_t steps) const {
  Weights drift;
  if (!enabled() || anchor_round_ != round - 1 || anchor_.empty()) return drift;
  POLLEN_ASSERT(anchor_.size() == global.size() && steps > 0);
  const float scale = static_cast<float>(beta_ / static_cast<double>(steps));
  for (size_t i = 0; i < global.size(); ++i) {
    // [shape of tensor i]: beta (a - x[t]) / H = beta (G - d) / H
    Tensor d = Tensor::empty(global[i].shape(), DType::f32);
    const float* a = anchor_[i].data<float>();
    const float* x = global[i].data<float>();
    float* o = d.data<float>();
    for (int64_t j = 0; j < d.numel(); ++j) o[j] = scale * (a[j] - x[j]);
    drift.push_back(std::move(d));
  }
  return drift;
}

Weights DriftCorrection::own_move(int64_t round, const Weights& global, const Weights& local,
                                  const Weights& drift, int64_t steps) {
  POLLEN_ASSERT(local.size() == global.size() && (drift.empty() || drift.size() == global.size()));
  const auto h = static_cast<float>(steps);
  Weights own = weights_minus(global, local);
  for (size_t i = 0; i < drift.size(); ++i) {
    const float* c = drift[i].data<float>();
    float* o = own[i].data<float>();
    for (int64_t j = 0; j < own[i].numel(); ++j) o[j] -= h * c[j];
  }
  if (enabled()) {
    anchor_ = weights_minus(global, own);
    anchor_round_ = round;
  }
  return own;
}

void DriftCorrection::restore(Weights anchor, int64_t round) {
  anchor_ = std::move(anchor);
  anchor_round_ = anchor_.empty() ? 0 : round;
}

}  // namespace pollen::fed
