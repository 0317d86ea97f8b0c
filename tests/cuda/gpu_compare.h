#pragma once
// Helpers for the GPU tests: skip without a GPU (saying why), fresh random inputs each run (the
// seed named in every failure), the same values upcast to f64 for the CPU reference, NaN-poisoned
// outputs with guards on both sides, and the error of a GPU result against its f64 reference:
// norm-relative over the tensor, and the worst element's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/rng.h"
#include "tensor/device.h"
#include "tensor/tensor.h"

namespace pollen::testing {

// Skips the test when no GPU can be used, with cuda_status()'s reason.
#define POLLEN_REQUIRE_GPU()                                                       \
  do {                                                                             \
    if (::pollen::cuda_devices().empty()) GTEST_SKIP() << ::pollen::cuda_status(); \
  } while (0)

// A fresh seed per run, also recorded in the test's JSON report.
inline uint64_t fresh_seed() {
  const uint64_t seed = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

// Declares `Rng name` with a fresh seed, and names the seed in every failure message of the
// enclosing scope (SCOPED_TRACE), so that a failing draw can be told apart and replayed.
#define POLLEN_FRESH_RNG(name)                                  \
  const uint64_t name##_seed = ::pollen::testing::fresh_seed(); \
  SCOPED_TRACE(::testing::Message() << "seed=" << name##_seed); \
  ::pollen::Rng name(name##_seed)

// Norm-relative error bound per tensor: bf16 paths and fp32 paths.
inline double tolerance(DType t) {
  return t == DType::bf16 ? 1e-2 : 1e-4;
}

// The worst element's bound, against the reference's rms: kWorstElementFactor times the norm
// bound, 0.1 rms for bf16 and 1e-3 rms for f32. Why 10: a correct kernel's element errors are
// roundings. A bf16 output is rounded once after fp32 math (2^-9 of the element, relative), and
// may carry roundings of bf16 intermediates (the logits' gradient before its GEMMs): at most
// about 1% of the element itself. The largest elements here are about 5.5 rms (the largest of
// ~17 M normal draws) to 8 rms (products of two, as mul's, over thousands), so a correct bf16
// element could be off by 0.08 rms only if the worst rounding met the largest element, and is
// usually off by under 0.02 (one rounding: 2^-9 of 8 rms); f32 paths by ~1e-6 rms. A wrong element
// (garbage, a stale value, a row computed from the wrong inputs) is off by about its own size: over
// 0.1 rms unless it is among the smallest. (Attention's dq and dk in bf16 need more, for a reason
// of their own: attention_test.cpp.)
inline constexpr double kWorstElementFactor = 10;
inline double worst_tolerance(DType t) {
  return kWorstElementFactor * tolerance(t);
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

// A GPU output whose every element is NaN until the op writes it, inside a larger buffer whose
// kGuardBytes on either side hold kGuardValue: an op that writes past its output's ends changes
// them, and EXPECT_CLOSE checks them. It is the output tensor itself (a contiguous view into the
// buffer, 512-byte aligned as a tensor of its own), so it goes wherever a Tensor does; copied
// into a plain Tensor it keeps working and loses only the guards' check.
class Poisoned : public Tensor {
 public:
  static constexpr size_t kGuardBytes = 64 << 10;  // a tile of rows, e.g. 64 x 128 x 4 bytes
  static constexpr double kGuardValue = 12288;     // 3 * 2^12: exact in bf16, f32 and f64

  Poisoned(const Shape& shape, DType dtype) {
    const int64_t guard = static_cast<int64_t>(kGuardBytes / dtype_size(dtype));
    const int64_t n = shape_numel(shape);
    buffer_ = Tensor::empty({guard + n + guard}, dtype, Device::cuda);
    buffer_.fill_(kGuardValue);
    Tensor out = buffer_.slice(0, guard, guard + n);
    out.fill_(std::nan(""));
    Tensor::operator=(out.view(shape));
    guards_ = {buffer_.slice(0, 0, guard), buffer_.slice(0, guard + n, guard + n + guard)};
  }

  // Whether both guards still hold kGuardValue in every element.
  bool guards_intact() const {
    for (const Tensor& g : guards_)
      for (double v : g.to_doubles())
        if (v != kGuardValue) return false;
    return true;
  }

 private:
  Tensor buffer_;
  std::vector<Tensor> guards_;  // before and after the output
};

inline Poisoned poisoned(const Shape& shape, DType dtype) {
  return Poisoned(shape, dtype);
}

// A guarded GPU output that starts from init's values: for outputs that accumulate (beta = 1,
// dw +=, y += alpha * x) or are rewritten in place.
inline Poisoned guarded_copy(const Tensor& init) {
  Poisoned out(init.shape(), init.dtype());
  out.copy_(init);
  return out;
}

// A GPU result against its f64 reference:
// - norm_relative: ||got - ref|| / ||ref|| over all elements (||got - ref|| when ref is zero);
// - worst_relative: max |got - ref| / rms(ref) (max |got - ref| when ref is zero), at flat index
//   worst_index, where got and ref held worst_got and worst_ref. The norm hides one wrong element
//   or row among thousands under its bound; the worst element does not.
// NaN anywhere in got makes both NaN, which fails every EXPECT_LT and EXPECT_LE.
struct Errors {
  double norm_relative = 0, worst_relative = 0;
  int64_t worst_index = -1;
  double worst_got = 0, worst_ref = 0;
};

inline Errors errors(const std::vector<double>& got, const std::vector<double>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  const size_t n = std::min(got.size(), ref.size());
  Errors e;
  double diff = 0, norm = 0, worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::abs(got[i] - ref[i]);
    if (std::isnan(d) || d > worst) {
      worst = d;
      e.worst_index = static_cast<int64_t>(i);
      e.worst_got = got[i];
      e.worst_ref = ref[i];
    }
    if (std::isnan(d)) break;
    diff += d * d;
    norm += ref[i] * ref[i];
  }
  if (std::isnan(worst)) {
    e.norm_relative = e.worst_relative = std::numeric_limits<double>::quiet_NaN();
    return e;
  }
  const double rms = n > 0 ? std::sqrt(norm / static_cast<double>(n)) : 0;
  e.norm_relative = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  e.worst_relative = rms > 0 ? worst / rms : worst;
  return e;
}

inline Errors errors(const Tensor& got, const Tensor& ref) {
  EXPECT_EQ(got.shape(), ref.shape());
  return errors(got.to_doubles(), ref.to_doubles());
}

inline double rel_err(const Tensor& got, const Tensor& ref) {
  return errors(got, ref).norm_relative;
}

// EXPECT_CLOSE checks the guards of a Poisoned output; a plain Tensor has none.
inline void expect_guards_intact(const Tensor&, const char*) {}
inline void expect_guards_intact(const Poisoned& got, const char* name) {
  EXPECT_TRUE(got.guards_intact()) << name << ": written past its ends (a guard changed)";
}

// The norm-relative error under tolerance(dtype), the worst element within worst_tolerance(dtype),
// and a Poisoned output's guards unchanged.
#define EXPECT_CLOSE(got, ref, dtype)                                                          \
  do {                                                                                         \
    const auto& pollen_got_ = (got);                                                           \
    const ::pollen::testing::Errors pollen_err_ = ::pollen::testing::errors(pollen_got_, ref); \
    EXPECT_LT(pollen_err_.norm_relative, ::pollen::testing::tolerance(dtype))                  \
        << #got << " vs " << #ref << " (" << ::pollen::dtype_name(dtype) << ")";               \
    EXPECT_LE(pollen_err_.worst_relative, ::pollen::testing::worst_tolerance(dtype))           \
        << #got << " vs " << #ref << " (" << ::pollen::dtype_name(dtype)                       \
        << "), the worst element in rms of the reference: at flat index "                      \
        << pollen_err_.worst_index << ", " << pollen_err_.worst_got << " for "                 \
        << pollen_err_.worst_ref;                                                              \
    ::pollen::testing::expect_guards_intact(pollen_got_, #got);                                \
  } while (0)

}  // namespace pollen::testing
