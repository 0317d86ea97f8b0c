// GPU memory: the caching allocator's reuse and statistics, copies between host and GPU (with
// conversions and strided views), zero_ and fill_ on the GPU, and a clear error without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cuda/gpu_compare.h"
#include "tensor/cuda_memory.h"

namespace pollen {
namespace {

using testing::random_input;

// The caching allocator's own tests count its blocks and segments, which POLLEN_CUDA_NO_CACHING=1
// does away with: they skip then (gpu-check's memcheck pass, which sets it, leaves them out).
#define REQUIRE_CACHING()                                                                    \
  do {                                                                                       \
    if (!CudaAllocator::caching())                                                           \
      GTEST_SKIP() << "POLLEN_CUDA_NO_CACHING=1: every tensor has its own cudaMalloc, so "   \
                      "there are no blocks to reuse, split or merge, nor segments to count"; \
  } while (0)

TEST(CudaAllocator, BlocksAreMultiplesOf512Bytes) {
  EXPECT_EQ(CudaAllocator::size_class(1), 512u);
  EXPECT_EQ(CudaAllocator::size_class(512), 512u);
  EXPECT_EQ(CudaAllocator::size_class(513), 1024u);
  EXPECT_EQ(CudaAllocator::size_class(size_t{1} << 20), size_t{1} << 20);
  EXPECT_EQ(CudaAllocator::size_class((size_t{1} << 20) + 1), (size_t{1} << 20) + 512);
  EXPECT_EQ(CudaAllocator::size_class(size_t{3} << 29), size_t{3} << 29);
}

TEST(CudaAllocator, RefusedWithoutGpu) {
  if (!cuda_devices().empty()) GTEST_SKIP() << "a GPU is present: " << cuda_status();
  try {
    Tensor::empty({4}, DType::f32, Device::cuda);
    FAIL() << "a GPU tensor was allocated without a GPU";
  } catch (const Error& e) {
    // The failing CUDA call and its error, or the missing backend.
    const std::string what = e.what();
    RecordProperty("error", what);
    const char* expected = cuda_built() ? " failed: cuda" : "built without the CUDA backend";
    EXPECT_NE(what.find(expected), std::string::npos) << what;
  }
}

// Whether the allocator caches or not (POLLEN_CUDA_NO_CACHING=1, as in gpu-check's memcheck
// pass): bytes in use rise by the block's size and fall back, and the peak follows them.
TEST(CudaAllocator, CountsBytesInUseAndTheirPeak) {
  POLLEN_REQUIRE_GPU();
  CudaAllocator& a = CudaAllocator::instance();
  const size_t cls = CudaAllocator::size_class(3000 * 4);
  a.reset_peak();
  const AllocatorStats before = a.stats();
  {
    Tensor t = Tensor::empty({3000}, DType::f32, Device::cuda);
    t.zero_();
    const AllocatorStats held = a.stats();
    EXPECT_EQ(held.in_use_bytes, before.in_use_bytes + cls);
    EXPECT_EQ(held.peak_in_use_bytes, held.in_use_bytes);
    EXPECT_GE(held.peak_reserved_bytes, held.in_use_bytes + held.cached_bytes);
  }
  const AllocatorStats after = a.stats();
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(after.peak_in_use_bytes, before.in_use_bytes + cls);
  if (!CudaAllocator::caching()) {  // nothing held beyond what is in use; a cudaMalloc a tensor
    EXPECT_EQ(after.cached_bytes, 0u);
    EXPECT_EQ(after.system_allocs, before.system_allocs + 1);
    EXPECT_EQ(after.reuses, before.reuses);
  }
}

TEST(CudaCachingAllocator, ReusesFreedBlocksAndCountsThem) {
  POLLEN_REQUIRE_GPU();
  REQUIRE_CACHING();
  CudaAllocator& a = CudaAllocator::instance();
  const size_t bytes = 3000 * 4, cls = CudaAllocator::size_class(bytes);
  const AllocatorStats before = a.stats();
  {
    Tensor t = Tensor::empty({3000}, DType::f32, Device::cuda);
    const AllocatorStats held = a.stats();
    EXPECT_EQ(held.in_use_bytes, before.in_use_bytes + cls);
    EXPECT_GE(held.peak_in_use_bytes, held.in_use_bytes);
    EXPECT_GE(held.peak_reserved_bytes, held.in_use_bytes + held.cached_bytes);
  }
  const AllocatorStats released = a.stats();
  EXPECT_EQ(released.in_use_bytes, before.in_use_bytes);
  EXPECT_GE(released.cached_bytes, cls);
  {
    Tensor again = Tensor::empty({3000}, DType::f32, Device::cuda);
    const AllocatorStats reused = a.stats();
    EXPECT_EQ(reused.reuses, released.reuses + 1);
    EXPECT_EQ(reused.system_allocs, released.system_allocs);
    EXPECT_EQ(reused.cached_bytes, released.cached_bytes - cls);
  }
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_in_use_bytes, a.stats().in_use_bytes);
  EXPECT_EQ(a.stats().peak_reserved_bytes, a.stats().in_use_bytes + a.stats().cached_bytes);
  // Wholly free segments go back to the driver: with nothing in use, all of them.
  a.empty_cache();
  const AllocatorStats emptied = a.stats();
  EXPECT_LT(emptied.cached_bytes, released.cached_bytes);
  if (emptied.in_use_bytes == 0) EXPECT_EQ(emptied.cached_bytes, 0u);
}

TEST(CudaCachingAllocator, MemoryFreedInOneShapeServesAnother) {
  POLLEN_REQUIRE_GPU();
  REQUIRE_CACHING();
  CudaAllocator& a = CudaAllocator::instance();
  a.empty_cache();
  a.reset_peak();
  const AllocatorStats start = a.stats();
  constexpr int64_t kMiB = 1 << 18;                                     // f32 values in a MiB
  { Tensor t = Tensor::empty({32 * kMiB}, DType::f32, Device::cuda); }  // its own segment
  const AllocatorStats freed = a.stats();
  EXPECT_EQ(freed.system_allocs, start.system_allocs + 1);
  EXPECT_EQ(freed.cached_bytes, start.cached_bytes + (32 << 20));
  {
    // Three tensors of other sizes, at once, out of those 32 MiB: no cudaMalloc.
    Tensor x = Tensor::empty({12 * kMiB}, DType::f32, Device::cuda);
    Tensor y = Tensor::empty({3 * kMiB, 4}, DType::bf16, Device::cuda);  // 6 MiB
    Tensor z = Tensor::empty({5 * kMiB}, DType::f32, Device::cuda);
    z.zero_();  // and the memory works
    const AllocatorStats held = a.stats();
    EXPECT_EQ(held.system_allocs, freed.system_allocs);
    EXPECT_EQ(held.in_use_bytes, start.in_use_bytes + (23 << 20));
    EXPECT_EQ(static_cast<char*>(y.raw()) - static_cast<char*>(x.raw()), 12 << 20);
    EXPECT_EQ(z.to(Device::cpu).to_doubles(), std::vector<double>(5 * kMiB, 0.0));
  }
  const AllocatorStats after = a.stats();
  EXPECT_EQ(after.peak_in_use_bytes, start.in_use_bytes + (32 << 20));
  EXPECT_EQ(after.peak_reserved_bytes, start.in_use_bytes + start.cached_bytes + (32 << 20));
  a.empty_cache();  // the three blocks merged back: the segment goes back whole
  EXPECT_EQ(a.stats().cached_bytes, start.cached_bytes);
}

TEST(CudaCopy, RoundTripsEveryDtypeExactly) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  for (DType t : {DType::f64, DType::f32, DType::bf16, DType::i32, DType::u8}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor host = Tensor::empty({7, 33}, t);
    for (int64_t i = 0; i < host.numel(); ++i) {
      Tensor one = Tensor::full({1}, std::floor(rng.uniform() * 200), t);
      std::memcpy(static_cast<char*>(host.raw()) + i * dtype_size(t), one.raw(), dtype_size(t));
    }
    const Tensor gpu = host.to(Device::cuda);
    EXPECT_EQ(gpu.device(), Device::cuda);
    const Tensor gpu2 = gpu.clone();  // device to device
    EXPECT_FALSE(gpu2.shares_storage(gpu));
    const Tensor back = gpu2.to(Device::cpu);
    EXPECT_EQ(std::memcmp(back.raw(), host.raw(), host.nbytes()), 0);
  }
}

TEST(CudaCopy, ConvertsOnTheGpuAsTheHostDoes) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  Tensor host = random_input({5, 41}, DType::f64, rng, 3.0).ref;
  // Infinities convert bit for bit; a NaN stays a NaN (its payload may differ: the GPU's
  // conversion gives the canonical NaN, the host keeps the sign).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> specials = {nan, -nan, inf, -inf, 0.0, -0.0};
  for (size_t i = 0; i < specials.size(); ++i) host.data<double>()[7 * i + 3] = specials[i];
  for (DType from : {DType::f64, DType::f32, DType::bf16}) {
    for (DType to : {DType::f64, DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
      const Tensor src = host.to(from);
      const Tensor want_bits = src.to(to);
      const Tensor got = src.to(Device::cuda).to(to).to(Device::cpu);
      const std::vector<double> want = want_bits.to_doubles(), got_values = got.to_doubles();
      const size_t item = want_bits.nbytes() / want.size();
      for (size_t i = 0; i < want.size(); ++i) {
        if (std::isnan(want[i])) {
          EXPECT_TRUE(std::isnan(got_values[i])) << "element " << i;
        } else {
          EXPECT_EQ(std::memcmp(static_cast<const char*>(got.raw()) + i * item,
                                static_cast<const char*>(want_bits.raw()) + i * item, item),
                    0)
              << "element " << i;
        }
      }
    }
  }
}

TEST(CudaCopy, StridedViewsBothWays) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  const Tensor host = random_input({4, 6}, DType::f32, rng).ref.to(DType::f32);
  const Tensor gpu = host.to(Device::cuda);
  // A transposed GPU view read back, and converted on the way.
  EXPECT_EQ(gpu.transpose(0, 1).to(Device::cpu).to_doubles(),
            host.transpose(0, 1).contiguous().to_doubles());
  EXPECT_EQ(gpu.transpose(0, 1).to(DType::bf16).to_doubles(),
            host.transpose(0, 1).to(DType::bf16).to_doubles());
  // Writing into a non-contiguous GPU view leaves the rest untouched.
  Tensor target = Tensor::zeros({4, 6}, DType::f32, Device::cuda);
  Tensor cols = target.slice(1, 2, 5);
  cols.copy_(host.slice(1, 0, 3));
  const std::vector<double> got = target.to_doubles(), src = host.to_doubles();
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 6; ++c) {
      const double want = (c >= 2 && c < 5) ? src[static_cast<size_t>(r * 6 + c - 2)] : 0.0;
      EXPECT_EQ(got[static_cast<size_t>(r * 6 + c)], want) << r << "," << c;
    }
  }
}

TEST(CudaCopy, OverlappingViewsOfOneStorage) {
  POLLEN_REQUIRE_GPU();
  POLLEN_FRESH_RNG(rng);
  Tensor host = random_input({1000}, DType::f32, rng).ref.to(DType::f32);
  Tensor gpu = host.to(Device::cuda);
  gpu.slice(0, 0, 900).copy_(gpu.slice(0, 100, 1000));  // as memmove
  host.slice(0, 0, 900).copy_(host.slice(0, 100, 1000));
  EXPECT_EQ(gpu.to_doubles(), host.to_doubles());
}

TEST(CudaFill, ZeroAndFillOnTheGpu) {
  POLLEN_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f64, DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = Tensor::empty({3, 1000}, t, Device::cuda);
    x.fill_(2.5);
    const double want = t == DType::i32 || t == DType::i64 ? 2.0 : 2.5;
    for (double v : x.to_doubles()) ASSERT_EQ(v, want);
    x.zero_();
    for (double v : x.to_doubles()) ASSERT_EQ(v, 0.0);
    Tensor row = x.slice(1, 10, 20);  // non-contiguous
    row.fill_(-1.0);
    const std::vector<double> got = x.to_doubles();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t col = i % 1000;
      ASSERT_EQ(got[static_cast<size_t>(i)], col >= 10 && col < 20 ? -1.0 : 0.0) << i;
    }
  }
  EXPECT_EQ(Tensor::zeros({5}, DType::f32, Device::cuda).to_doubles(), std::vector<double>(5, 0.0));
}

}  // namespace
}  // namespace pollen
