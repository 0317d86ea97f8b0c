#pragma once
// Inputs and error measures shared by the attention tests of the CUDA kernels (the CPU emulation
// of their tile schedule in tests/ops, the GPU run in tests/cuda).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "base/rng.h"
#include "tensor/tensor.h"

namespace pollen::testing {

// seg_start (batch, seq): documents of 1 to max_run tokens packed along each row.
inline std::vector<int32_t> random_seg_start(int64_t batch, int64_t seq, int64_t max_run,
                                             Rng& rng) {
  std::vector<int32_t> seg(static_cast<size_t>(batch * seq));
  for (int64_t b = 0; b < batch; ++b) {
    int64_t start = 0, left = 0;
    for (int64_t t = 0; t < seq; ++t, --left) {
      if (left == 0) {
        start = t;
        left = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_run)));
      }
      seg[static_cast<size_t>(b * seq + t)] = static_cast<int32_t>(start);
    }
  }
  return seg;
}

// ||got - want|| / ||want|| against an f64 tensor; NaN (so every comparison fails) when any
// element of got is not finite.
template <typename T>
double relative_error(const std::vector<T>& got, const Tensor& want) {
  const double* w = want.data<double>();
  EXPECT_EQ(static_cast<int64_t>(got.size()), want.numel());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) return std::numeric_limits<double>::quiet_NaN();
    diff += (g - w[i]) * (g - w[i]);
    norm += w[i] * w[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace pollen::testing
