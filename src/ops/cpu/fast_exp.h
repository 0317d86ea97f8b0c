#pragma once
// exp for float in plain branch-free arithmetic that the compiler vectorises (AVX2/AVX-512):
// exp(x) = 2^n * p(r), n = round(x / ln2), r = x - n ln2 in two parts (Cody-Waite), p a degree-6
// polynomial. Relative error below 2e-7 (about 2 ulp) on [-87, 88]; below -87 it returns 0
// (softmax and sigmoid underflow), above 88 it saturates at 2^127 * p(r) instead of inf.
#include <cstdint>
#include <cstring>

namespace pollen::ops::cpu {

inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_roundevenf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // ln2 high part (exact in float)
  r = r - n * -2.12194440e-4f;     // ln2 low part
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.0f ? 0.0f : p * scale;
}

}  // namespace pollen::ops::cpu
