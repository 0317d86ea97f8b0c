#pragma once
// Tensor-core products for the attention kernels, one warp at a time: (16,16) tiles of bf16 in
// shared memory multiplied with fp32 accumulation, C (16,16) += A (16,16) B (16,16).
//
// On the GPU these are nvcuda::wmma calls that all 32 lanes of a warp make together, with the
// same arguments. On the CPU (tests/ops/cuda_attention_tiles_test.cpp) a block's phases run one
// thread at a time, so lane 0 of each warp computes the warp's whole tile and the other lanes do
// nothing; there an accumulator holds the whole tile. The CPU side also enforces WMMA's rules for
// the pointers (32-byte aligned) and the leading dimensions (a multiple of 8 bf16 or of 4
// floats), so a call the GPU would get wrong fails the CPU test.
//
// Leading dimension ld, in elements: a row-major tile's (r, c) lies at p[r * ld + c], a
// column-major one's at p[r + c * ld].
#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__)
#include <cuda_bf16.h>
#include <mma.h>
#else
#include <stdexcept>
#include <string>

#include "tensor/dtype.h"
#endif

#include "ops/cuda/attention_tiles.h"

namespace pollen::ops::cuda {

constexpr int kWarpSize = 32;
constexpr int kMmaTile = 16;  // every tile is (16,16)

#if defined(__CUDA_ARCH__)

using MmaBf16 = __nv_bfloat16;
struct MmaAccumulator {
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kMmaTile, kMmaTile, kMmaTile, float> f;
};

__device__ __forceinline__ MmaBf16 to_mma_bf16(float x) {
  return __float2bfloat16_rn(x);
}
__device__ __forceinline__ float from_mma_bf16(MmaBf16 x) {
  return __bfloat162float(x);
}

// c = 0.
__device__ __forceinline__ void mma_zero(int, MmaAccumulator& c) {
  nvcuda::wmma::fill_fragment(c.f, 0.0f);
}
// c = the row-major f32 tile at p.
__device__ __forceinline__ void mma_load(int, MmaAccumulator& c, const float* p, int ld) {
  nvcuda::wmma::load_matrix_sync(c.f, p, ld, nvcuda::wmma::mem_row_major);
}
// The row-major f32 tile at p = c.
__device__ __forceinline__ void mma_store(int, float* p, const MmaAccumulator& c, int ld) {
  nvcuda::wmma::store_matrix_sync(p, c.f, ld, nvcuda::wmma::mem_row_major);
}
// c += a b, a and b bf16 tiles, column-major when kACol / kBCol.
template <bool kACol, bool kBCol>
__device__ __forceinline__ void mma(int, MmaAccumulator& c, const MmaBf16* a, int lda,
                                    const MmaBf16* b, int ldb) {
  namespace wmma = nvcuda::wmma;
  using ALayout = std::conditional_t<kACol, wmma::col_major, wmma::row_major>;
  using BLayout = std::conditional_t<kBCol, wmma::col_major, wmma::row_major>;
  wmma::fragment<wmma::matrix_a, kMmaTile, kMmaTile, kMmaTile, MmaBf16, ALayout> fa;
  wmma::fragment<wmma::matrix_b, kMmaTile, kMmaTile, kMmaTile, MmaBf16, BLayout> fb;
  wmma::load_matrix_sync(fa, a, lda);
  wmma::load_matrix_sync(fb, b, ldb);
  wmma::mma_sync(c.f, fa, fb, c.f);
}

#else  // the CPU's emulation

using MmaBf16 = ::pollen::bf16;
struct MmaAccumulator {
  float v[kMmaTile][kMmaTile];  // lane 0's: the whole tile
};

inline MmaBf16 to_mma_bf16(float x) {
  return MmaBf16::from_float(x);
}
inline float from_mma_bf16(MmaBf16 x) {
  return x.to_float();
}

// WMMA's rules: a 256-bit aligned pointer, and a leading dimension of a multiple of 16 bytes.
inline void check_mma_operand(const void* p, int ld, int element_bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    throw std::logic_error(std::string(what) + ": pointer not 32-byte aligned");
  if ((ld * element_bytes) % 16 != 0)
    throw std::logic_error(std::string(what) + ": leading dimension not a multiple of 16 bytes");
}

inline void mma_zero(int lane, MmaAccumulator& c) {
  if (lane != 0) return;
  for (auto& row : c.v)
    for (float& x : row) x = 0.0f;
}
inline void mma_load(int lane, MmaAccumulator& c, const float* p, int ld) {
  if (lane != 0) return;
  check_mma_operand(p, ld, 4, "mma_load");
  for (int r = 0; r < kMmaTile; ++r)
    for (int col = 0; col < kMmaTile; ++col) c.v[r][col] = p[r * ld + col];
}
inline void mma_store(int lane, float* p, const MmaAccumulator& c, int ld) {
  if (lane != 0) return;
  check_mma_operand(p, ld, 4, "mma_store");
  for (int r = 0; r < kMmaTile; ++r)
    for (int col = 0; col < kMmaTile; ++col) p[r * ld + col] = c.v[r][col];
}
template <bool kACol, bool kBCol>
void mma(int lane, MmaAccumulator& c, const MmaBf16* a, int lda, const MmaBf16* b, int ldb) {
  if (lane != 0) return;
  check_mma_operand(a, lda, 2, "mma (a)");
  check_mma_operand(b, ldb, 2, "mma (b)");
  for (int m = 0; m < kMmaTile; ++m) {
    for (int n = 0; n < kMmaTile; ++n) {
      float sum = c.v[m][n];
      for (int k = 0; k < kMmaTile; ++k) {
        const float am = from_mma_bf16(kACol ? a[m + k * lda] : a[m * lda + k]);
        const float bn = from_mma_bf16(kBCol ? b[k + n * ldb] : b[k * ldb + n]);
        sum += am * bn;
      }
      c.v[m][n] = sum;
    }
  }
}

#endif

// Eight elements from src, or zeros when src is null, into eight bf16 at dst (16-byte aligned).
// On the GPU bf16 elements at a 16-byte aligned src move as one 16-byte copy.
constexpr int kBf16PerCopy = 8;
template <typename T>
POLLEN_HD void copy_to_bf16(const T* src, MmaBf16* dst) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, MmaBf16>) {
    if (reinterpret_cast<uintptr_t>(src) % 16 == 0) {  // null too: zeros
      *reinterpret_cast<uint4*>(dst) =
          src ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
      return;
    }
  }
#else
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    throw std::logic_error("copy_to_bf16: destination not 16-byte aligned");
#endif
  for (int i = 0; i < kBf16PerCopy; ++i)
    dst[i] = to_mma_bf16(src ? Element<T>::load(src[i]) : 0.0f);
}

}  // namespace pollen::ops::cuda
