#pragma once
// Helpers for the GPU tests: skip without a GPU (saying why), fresh random inputs each run, the
// same values upcast to f64 for the CPU reference, NaN-poisoned outputs, and the norm-relative
// error of a GPU result against its f64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "base/rng.h"
#include "tensor/device.h"
#include "tensor/tensor.h"

namespace pollen::testing {

// Skips the test when no GPU can be used, with cuda_status()'s reason.
#define POLLEN_REQUIRE_GPU()                                                       \
  do {                                                                             \
    if (::pollen::cuda_devices().empty()) GTEST_SKIP() << ::pollen::cuda_status(); \
  } while (0)

// A fresh seed per run, recorded in the test's output so that a failure can be replayed.
inline Rng fresh_rng() {
  const uint64_t seed = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return Rng(seed);
}

// Norm-relative error bound per tensor: bf16 paths and fp32 paths.
inline double tolerance(DType t) {
  return t == DType::bf16 ? 1e-2 : 1e-4;
}

// One input drawn once: `gpu` holds it in the tested dtype on the GPU, `ref` the same (rounded)
// values as f64 on the CPU, for the reference op.
struct Input {
  Tensor gpu, ref;
};

// Elements offset + scale * N(0, 1).
inline Input random_input(const Shape& shape, DType dtype, Rng& rng, double scale = 1.0,
                          double offset = 0.0) {
  Tensor host = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < host.numel(); ++i) host.data<double>()[i] = offset + scale * rng.normal();
  const Tensor rounded = host.to(dtype);
  return {rounded.to(Device::cuda), rounded.to(DType::f64)};
}

// The same integer tensor on both sides (ids, targets, positions).
inline Input int_input(const Shape& shape, const std::vector<int32_t>& values) {
  const Tensor host = Tensor::from<int32_t>(shape, values);
  return {host.to(Device::cuda), host};
}

// A GPU output whose every element is NaN until the op writes it.
inline Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda);
  t.fill_(std::nan(""));
  return t;
}

// ||got - ref|| / ||ref|| over all elements (||got - ref|| when ref is zero); NaN anywhere in
// got makes it NaN, which fails every EXPECT_LT.
inline double rel_err(const Tensor& got, const Tensor& ref) {
  EXPECT_EQ(got.shape(), ref.shape());
  const std::vector<double> g = got.to_doubles(), r = ref.to_doubles();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < g.size() && i < r.size(); ++i) {
    diff += (g[i] - r[i]) * (g[i] - r[i]);
    norm += r[i] * r[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

#define EXPECT_CLOSE(got, ref, dtype)                                            \
  do {                                                                           \
    const double pollen_err_ = ::pollen::testing::rel_err(got, ref);             \
    EXPECT_LT(pollen_err_, ::pollen::testing::tolerance(dtype))                  \
        << #got << " vs " << #ref << " (" << ::pollen::dtype_name(dtype) << ")"; \
  } while (0)

}  // namespace pollen::testing
