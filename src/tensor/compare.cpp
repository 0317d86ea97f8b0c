#include "tensor/compare.h"

#include "base/error.h"

namespace pollen {

int64_t first_difference_as_f32(const Tensor& a, const Tensor& b) {
  POLLEN_ASSERT(a.shape() == b.shape());
  const Tensor x = a.to(DType::f32).contiguous(), y = b.to(DType::f32).contiguous();
  const auto* p = reinterpret_cast<const uint32_t*>(x.data<float>());
  const auto* q = reinterpret_cast<const uint32_t*>(y.data<float>());
  for (int64_t i = 0; i < x.numel(); ++i)
    if (p[i] != q[i]) return i;
  return -1;
}

}  // namespace pollen
