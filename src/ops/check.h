#pragma once
// Argument checks shared by the ops' dispatch points, and the dtype switch to their kernels.
#include <string>

#include "base/error.h"
#include "tensor/tensor.h"

namespace pollen::ops {

// Requires a defined, contiguous tensor of the given dtype and shape on `device` (an op's tensors
// all live on one device); -1 in `shape` matches any size. Errors read
// "rmsnorm: x: expected shape (N, 384) f32, got (8, 256) f32" or "add: out is on cpu, expected
// cuda like the op's other tensors".
void expect(const char* op, const char* name, const Tensor& t, const Shape& shape, DType dtype,
            Device device = Device::cpu);

// The same with the expected layout named in the error ("(B,T,H,D)"): a defined, contiguous CPU
// tensor of exactly this dtype and shape.
void check_tensor(const char* op, const char* name, const Tensor& t, DType dtype,
                  const Shape& shape, const char* layout);

// The dtype of an op's per-row statistics (rmsnorm's rstd, attention's lse, a loss): the
// input's on the CPU; f32 on the GPU, where f32 and bf16 inputs are both computed in f32.
DType statistics_dtype(const Tensor& x);

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

}  // namespace pollen::ops
