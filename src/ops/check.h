#pragma once
// Argument checks shared by the ops' dispatch points, and the dtype switch to their kernels.
#include <string>

#include "base/error.h"
#include "tensor/tensor.h"

namespace pollen::ops {

// Requires a defined, contiguous tensor of the given dtype and shape; -1 in `shape` matches any
// size. Errors read "rmsnorm: x: expected shape (N, 384) f32, got (8, 256) f32".
void expect(const char* op, const char* name, const Tensor& t, const Shape& shape, DType dtype);

// The same with the expected layout named in the error ("(B,T,H,D)"): a defined, contiguous CPU
// tensor of exactly this dtype and shape.
void check_tensor(const char* op, const char* name, const Tensor& t, DType dtype,
                  const Shape& shape, const char* layout);

// Calls f(float{}) or f(double{}) for the float compute dtypes; other dtypes are an error.
template <typename F>
void dispatch_float(const char* op, DType dtype, F&& f) {
  if (dtype == DType::f32) {
    f(float{});
  } else if (dtype == DType::f64) {
    f(double{});
  } else {
    fail(op, ": compute dtype must be f32 or f64 on CPU, got ", dtype_name(dtype));
  }
}

inline void expect_cpu(const char* op, const Tensor& t) {
  POLLEN_CHECK(t.device() == Device::cpu, op, ": tensor on ", device_name(t.device()),
               ", this op runs on cpu only in this build");
}

}  // namespace pollen::ops
