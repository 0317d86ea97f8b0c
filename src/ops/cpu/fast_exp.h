#pragma once
// exp for float in plain branch-free arithmetic that the compiler vectorises (built with
// -fno-trapping-math so that the clamps become vector min/max): exp(x) = 2^n * p(r),
// n = round(x / ln2) by the 1.5 * 2^23 shift, r = x - n ln2 in two parts (Cody-Waite), p a
// degree-6 polynomial. Relative error below 2.5e-7 (about 2 ulp) on [-87, 88]; at or below -87
// it returns 0 (softmax and sigmoid underflow), above 88 it saturates instead of giving inf; NaN
// gives NaN (a broken model's loss must not look finite).
#include <algorithm>
#include <bit>
#include <cstdint>

namespace pollen::ops::cpu {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifted = x * 1.44269504088896341f + 12582912.0f;  // rounds x/ln2 to an integer
  const float n = shifted - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln2 high part (exact in float)
  r = r - n * -2.12194440e-4f;     // ln2 low part
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // The integer n sits in the low mantissa bits of `shifted`: move it into the exponent field.
  const int32_t exponent = std::bit_cast<int32_t>(shifted) - 0x4B400000 + 127;
  const float scale = std::bit_cast<float>(exponent << 23);
  return !(x <= -87.0f) ? p * scale : 0.0f;  // NaN stays NaN
}

}  // namespace pollen::ops::cpu
