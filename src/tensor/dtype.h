#pragma once
// Element types: f64 and f32 compute on CPU (f64 for references and gradient checks), bf16 and
// f16 for storage and conversion, integers for token ids and indices.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace pollen {

enum class DType : uint8_t { f64, f32, bf16, f16, i64, i32, u32, u16, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType parse_dtype(const std::string& name);  // "f32", "bf16", ...; throws naming the value
bool dtype_is_float(DType t);

// bfloat16: the top 16 bits of an IEEE float32; conversion rounds to nearest even, NaN stays NaN.
struct bf16 {
  uint16_t bits = 0;
  static bf16 from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      r.bits = static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
    } else {
      r.bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
  }
  float to_float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// IEEE half precision, converted in software (round to nearest even, subnormals, inf, NaN).
struct f16 {
  uint16_t bits = 0;
  static f16 from_float(float f);
  float to_float() const;
};

template <typename T>
struct dtype_of;
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<uint32_t> {
  static constexpr DType value = DType::u32;
};
template <>
struct dtype_of<uint16_t> {
  static constexpr DType value = DType::u16;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::u8;
};

}  // namespace pollen
