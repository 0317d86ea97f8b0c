#include "ops/check.h"

namespace pollen::ops {

void expect(const char* op, const char* name, const Tensor& t, const Shape& shape, DType dtype,
            Device device) {
  POLLEN_CHECK(t.defined(), op, ": ", name, " is undefined");
  bool ok = t.dtype() == dtype && t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == t.shape()[i];
  if (!ok) {
    std::string want = "(";
    for (size_t i = 0; i < shape.size(); ++i)
      want += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    want += ")";
    fail(op, ": ", name, ": expected shape ", want, " ", dtype_name(dtype), ", got ",
         shape_str(t.shape()), " ", dtype_name(t.dtype()));
  }
  POLLEN_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  POLLEN_CHECK(t.device() == device, op, ": ", name, " is on ", device_name(t.device()),
               ", expected ", device_name(device), " like the op's other tensors");
}

void check_tensor(const char* op, const char* name, const Tensor& t, DType dtype,
                  const Shape& shape, const char* layout) {
  POLLEN_CHECK(t.defined(), op, ": ", name, " is undefined; expected ", layout, " ",
               shape_str(shape));
  POLLEN_CHECK(t.device() == Device::cpu, op, ": ", name, " is on ", device_name(t.device()),
               "; only the CPU kernel exists");
  POLLEN_CHECK(t.dtype() == dtype, op, ": ", name, " has dtype ", dtype_name(t.dtype()),
               ", expected ", dtype_name(dtype));
  POLLEN_CHECK(t.shape() == shape, op, ": ", name, " has shape ", shape_str(t.shape()),
               ", expected ", layout, " ", shape_str(shape));
  POLLEN_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

DType statistics_dtype(const Tensor& x) {
  return x.device() == Device::cuda ? DType::f32 : x.dtype();
}

}  // namespace pollen::ops
