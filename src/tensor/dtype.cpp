#include "tensor/dtype.h"

#include "base/error.h"

namespace pollen {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
    case DType::u32:
      return 4;
    case DType::bf16:
    case DType::f16:
    case DType::u16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f64:
      return "f64";
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i64:
      return "i64";
    case DType::i32:
      return "i32";
    case DType::u32:
      return "u32";
    case DType::u16:
      return "u16";
    case DType::u8:
      return "u8";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  for (DType t : {DType::f64, DType::f32, DType::bf16, DType::f16, DType::i64, DType::i32,
                  DType::u32, DType::u16, DType::u8}) {
    if (name == dtype_name(t)) return t;
  }
  fail("unknown dtype '", name, "': expected one of f64, f32, bf16, f16, i64, i32, u32, u16, u8");
}

bool dtype_is_float(DType t) {
  return t == DType::f64 || t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

f16 f16::from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  f16 r;
  if (abs > 0x7f800000u) {  // NaN
    r.bits = static_cast<uint16_t>(sign | 0x7e00u);
  } else if (abs >= 0x477ff000u) {  // rounds to >= 65520: infinity
    r.bits = static_cast<uint16_t>(sign | 0x7c00u);
  } else if (abs < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
    // Add 0.5 in the magic-number trick: the float adder rounds to nearest even for us.
    float magic;
    uint32_t m = 0x3f000000u;  // 0.5
    std::memcpy(&magic, &m, 4);
    float a;
    std::memcpy(&a, &abs, 4);
    a += magic;
    uint32_t au;
    std::memcpy(&au, &a, 4);
    r.bits = static_cast<uint16_t>(sign | (au - m));
  } else {
    uint32_t mant_odd = (abs >> 13) & 1u;
    abs += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
    r.bits = static_cast<uint16_t>(sign | (abs >> 13));
  }
  return r;
}

float f16::to_float() const {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1fu;
  uint32_t mant = bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace pollen
