#pragma once
// Whether two tensors of one shape hold the same values bit for bit once widened to float32
// (bf16 and f16 widen exactly): for files that carry a copy of another tensor.
#include <cstdint>

#include "tensor/tensor.h"

namespace pollen {

// The index of the first element whose float32 bits differ; -1 when none does. Shapes must agree.
int64_t first_difference_as_f32(const Tensor& a, const Tensor& b);

}  // namespace pollen
