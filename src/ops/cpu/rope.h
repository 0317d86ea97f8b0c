#pragma once
// CPU kernel behind ops/rope.h. Inputs are checked by the caller.
#include <cstdint>

namespace pollen::ops::cpu {

// x (B*T rows, H, D) rotated by +angle (forward) or -angle (backward, the transpose), where
// angle = positions[row] * theta^(-2i/D). out may equal x.
template <typename T>
void rope_rotate(const T* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, double theta, bool inverse, T* out);

}  // namespace pollen::ops::cpu
