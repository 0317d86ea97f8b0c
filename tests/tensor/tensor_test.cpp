// Tensors: views share storage, conversions round correctly, the allocator reuses memory.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tensor/allocator.h"
#include "tensor/tensor.h"

namespace pollen {
namespace {

TEST(Tensor, ViewsSliceAndTranspose) {
  Tensor t = Tensor::from<float>({2, 3}, {0, 1, 2, 3, 4, 5});
  Tensor v = t.view({3, -1});
  EXPECT_EQ(v.shape(), (Shape{3, 2}));
  EXPECT_TRUE(v.shares_storage(t));
  Tensor s = t.slice(1, 1, 3);
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(s.to_doubles(), (std::vector<double>{1, 2, 4, 5}));
  EXPECT_EQ(t.transpose(0, 1).contiguous().to_doubles(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_THROW(t.view({4, 2}), Error);
  EXPECT_THROW(t.data<double>(), Error);
}

// A shape whose element or byte count does not fit is refused, not wrapped into a small buffer
// that the tensor's writers would then overrun.
TEST(Tensor, ShapesTooLargeToCountAreRefused) {
  auto error_of = [](const Shape& shape, DType dtype) {
    try {
      Tensor::empty(shape, dtype);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("allocated");
  };
  EXPECT_NE(error_of({int64_t{1} << 40, int64_t{1} << 40}, DType::f32)
                .find("has more elements than int64 holds"),
            std::string::npos);
  EXPECT_NE(error_of({int64_t{1} << 62}, DType::f64).find("has more bytes than fit"),
            std::string::npos);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16::from_float(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(bf16::from_float(1.00390625f).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(bf16::from_float(1.01171875f).bits, 0x3f82);
  EXPECT_TRUE(std::isnan(bf16::from_float(std::numeric_limits<float>::quiet_NaN()).to_float()));
}

TEST(DType, F16ConversionsAreExactWhereRepresentable) {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f})
    EXPECT_EQ(f16::from_float(f).to_float(), f) << f;
  EXPECT_EQ(f16::from_float(1.0f).bits, 0x3c00);
  EXPECT_TRUE(std::isinf(f16::from_float(65520.0f).to_float()));
  EXPECT_EQ(f16::from_float(65519.0f).to_float(), 65504.0f);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even.
  EXPECT_EQ(f16::from_float(1.00048828125f).bits, 0x3c00);
}

TEST(Tensor, ConvertsBetweenDtypes) {
  Tensor t = Tensor::from<double>({3}, {1.5, -2.0, 3.25});
  EXPECT_EQ(t.to(DType::bf16).to(DType::f32).to_doubles(), t.to_doubles());
  EXPECT_EQ(t.to(DType::f16).to_doubles(), t.to_doubles());
  EXPECT_EQ(t.to(DType::i32).to_doubles(), (std::vector<double>{1, -2, 3}));
}

TEST(Allocator, MemoryFreedInOneShapeServesAnother) {
  auto& a = CpuAllocator::instance();
  a.empty_cache();
  a.reset_peak();
  const AllocatorStats start = a.stats();
  EXPECT_EQ(start.peak_reserved_bytes, start.in_use_bytes + start.cached_bytes);
  constexpr int64_t kMiB = 1 << 18;                       // f32 values in a MiB
  { Tensor t = Tensor::empty({32 * kMiB}, DType::f32); }  // a segment of its own, then free
  const AllocatorStats freed = a.stats();
  EXPECT_EQ(freed.system_allocs, start.system_allocs + 1);
  EXPECT_EQ(freed.cached_bytes, start.cached_bytes + (32 << 20));
  {
    // Three tensors of other sizes, at once, out of those 32 MiB: no new segment.
    Tensor x = Tensor::empty({12 * kMiB}, DType::f32), y = Tensor::empty({3 * kMiB, 4}, DType::f32);
    Tensor z = Tensor::empty({5 * kMiB}, DType::f32);
    const AllocatorStats held = a.stats();
    EXPECT_EQ(held.system_allocs, freed.system_allocs);
    EXPECT_EQ(held.reuses, freed.reuses + 3);
    EXPECT_EQ(held.in_use_bytes, start.in_use_bytes + (29 << 20));
    EXPECT_EQ(held.cached_bytes, freed.cached_bytes - (29 << 20));
  }
  const AllocatorStats after = a.stats();
  // In tensors at most 32 MiB at a time, and never more held than the one segment.
  EXPECT_EQ(after.peak_in_use_bytes, start.in_use_bytes + (32 << 20));
  EXPECT_EQ(after.peak_reserved_bytes, start.in_use_bytes + start.cached_bytes + (32 << 20));
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_reserved_bytes, a.stats().in_use_bytes + a.stats().cached_bytes);
  EXPECT_EQ(a.stats().peak_in_use_bytes, a.stats().in_use_bytes);
  // The three blocks merged back into one: the segment is whole again and goes back.
  a.empty_cache();
  EXPECT_EQ(a.stats().cached_bytes, start.cached_bytes);
}

TEST(Allocator, ReusesFreedBlocks) {
  auto& a = CpuAllocator::instance();
  { Tensor warm = Tensor::empty({1000, 37}, DType::f32); }
  const auto before = a.stats();
  for (int i = 0; i < 10; ++i) Tensor t = Tensor::empty({1000, 37}, DType::f32);
  const auto after = a.stats();
  EXPECT_EQ(after.system_allocs, before.system_allocs);
  EXPECT_GE(after.reuses, before.reuses + 10);
}

}  // namespace
}  // namespace pollen
