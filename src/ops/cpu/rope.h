#pragma once
// CPU kernel behind ops/rope.h. Inputs are checked by the caller.
#include <cstdint>

#include "ops/rope.h"

namespace pollen::ops::cpu {

// x (B*T rows, H, D) rotated by +angle (forward) or -angle (backward, the transpose), where
// angle = positions[row] * rope_inv_freq(params, D, i). out may equal x.
template <typename T>
void rope_rotate(const T* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, const RopeParams& params, bool inverse, T* out);

}  // namespace pollen::ops::cpu
