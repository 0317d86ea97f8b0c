// GPU memory: the caching allocator, the default streams, and copies, fills and conversions.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "base/log.h"
#include "tensor/block_pool.h"
#include "tensor/cuda_context.h"
#include "tensor/cuda_memory.h"

namespace pollen {
namespace cuda {

namespace {
// "call [args] failed: name (text) at file:line"; clears the thread's last error unless it is
// sticky (then the context is lost anyway), so that the next launch check does not report it as
// its own.
std::string describe_failure(cudaError_t err, const char* call, const std::string& args,
                             const char* file, int line) {
  cudaGetLastError();
  return cat(call, args.empty() ? "" : " [", args, args.empty() ? "" : "]",
             " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") at ", file, ":",
             line);
}
}  // namespace

void fail_call(cudaError_t err, const char* call, const std::string& args, const char* file,
               int line) {
  throw Error(describe_failure(err, call, args, file, line));
}

void warn_call(cudaError_t err, const char* call, const std::string& args, const char* file,
               int line) {
  log::warn(describe_failure(err, call, args, file, line));
}

int current_device() {
  int device = 0;
  POLLEN_CUDA_CHECK(cudaGetDevice(&device), "");
  return device;
}

cudaStream_t default_stream() {
  static std::mutex mutex;
  static std::vector<cudaStream_t>* streams = new std::vector<cudaStream_t>();  // never freed
  const int device = current_device();
  std::lock_guard lock(mutex);
  if (streams->size() <= static_cast<size_t>(device))
    streams->resize(static_cast<size_t>(device) + 1, nullptr);
  cudaStream_t& s = (*streams)[static_cast<size_t>(device)];
  if (!s)
    POLLEN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "device=", device);
  return s;
}

}  // namespace cuda

namespace {

// With caching off (POLLEN_CUDA_NO_CACHING=1): a block that has its own cudaMalloc, and the
// stream whose work may still use it when it is released.
struct UncachedBlock {
  size_t size;
  cudaStream_t stream;
};

// One pool per GPU and stream: a block freed on a stream is reused by work on that stream,
// which runs after the block's last user, so no synchronisation is needed.
struct State {
  std::mutex mutex;
  std::map<std::pair<int, cudaStream_t>, std::unique_ptr<BlockPool>> pools;
  std::unordered_map<void*, BlockPool*> owner;        // the pool of each block handed out
  std::unordered_map<void*, UncachedBlock> uncached;  // with caching off, instead of the pools
  size_t uncached_bytes = 0;
  AllocatorStats stats;
};

size_t reserved_bytes(const State& s) {  // over all pools, and the uncached blocks
  size_t total = s.uncached_bytes;
  for (const auto& [key, pool] : s.pools) total += pool->reserved_bytes();
  return total;
}

State& state() {
  static State* s = new State();  // never destroyed: tensors may outlive static destructors
  return *s;
}

// cudaMalloc on the current GPU, `device`; nullptr when it has no room.
void* device_malloc(size_t bytes, int device) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;
  }
  if (err != cudaSuccess)
    cuda::fail_call(err, "cudaMalloc(&p, bytes)", cat("bytes=", bytes, " device=", device),
                    __FILE__, __LINE__);
  return p;
}

// Segments from cudaMalloc on `device`; nullptr when the GPU has no room.
BlockPool::Source device_segments(int device) {
  return {[device](size_t bytes) { return device_malloc(bytes, device); },
          [device](void* ptr, size_t) { POLLEN_CUDA_CHECK(cudaFree(ptr), "device=", device); }};
}

// Returns every wholly free segment of every pool to the driver, once the GPUs are done with
// them. The caller holds the lock.
void release_free_segments(State& s) {
  int previous = 0;
  POLLEN_CUDA_CHECK(cudaGetDevice(&previous), "");
  for (auto& [key, pool] : s.pools) {
    const int device = key.first;
    POLLEN_CUDA_CHECK(cudaSetDevice(device), "device=", device);
    POLLEN_CUDA_CHECK(cudaDeviceSynchronize(), "device=", device);  // the blocks' last users
    pool->release_free_segments();
  }
  POLLEN_CUDA_CHECK(cudaSetDevice(previous), "device=", previous);
  s.stats.cached_bytes = reserved_bytes(s) - s.stats.in_use_bytes;
}

// Names the request, what pollen holds, and what the GPU has free when the runtime can say (the
// part is left out when cudaMemGetInfo fails). The caller holds the lock.
[[noreturn]] void fail_out_of_memory(const State& s, int device, size_t bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (err != cudaSuccess) cudaGetLastError();  // not this error's cause: cleared, left unsaid
  const std::string gpu_free =
      err == cudaSuccess ? cat("; the GPU has ", free_bytes, " of ", total_bytes, " bytes free")
                         : "";
  const char* cache = CudaAllocator::caching() ? "free segments returned"
                                               : "caching off by POLLEN_CUDA_NO_CACHING=1";
  fail("out of GPU memory on device ", device, " allocating ", BlockPool::rounded(bytes),
       " bytes: pollen holds ", s.stats.in_use_bytes, " bytes in tensors and ", reserved_bytes(s),
       " in all (", cache, ")", gpu_free);
}

// With caching off: a cudaMalloc of the request's block size, for it alone. Stats count it as a
// segment from the driver that is wholly in use. The caller holds the lock.
void* allocate_uncached(State& s, size_t bytes, int device, cudaStream_t stream) {
  const size_t size = BlockPool::rounded(bytes);
  void* p = device_malloc(size, device);
  if (!p) fail_out_of_memory(s, device, bytes);
  s.uncached.emplace(p, UncachedBlock{size, stream});
  s.uncached_bytes += size;
  s.stats.handed_out(size, reserved_bytes(s), /*new_segment=*/true);
  return p;
}

// With caching off: waits for the block's stream, where work enqueued before the release may
// still use it (the pools need no wait: the block's next user runs after that work on the same
// stream), then frees it. Called from tensors' destructors: failures are warnings. The caller
// holds the lock.
void release_uncached(State& s, void* ptr) {
  const auto it = s.uncached.find(ptr);
  POLLEN_ASSERT(it != s.uncached.end());
  const UncachedBlock block = it->second;
  s.uncached.erase(it);
  s.uncached_bytes -= block.size;
  s.stats.given_back(block.size, reserved_bytes(s));
  POLLEN_CUDA_WARN(cudaStreamSynchronize(block.stream), "before freeing ", block.size, " bytes");
  POLLEN_CUDA_WARN(cudaFree(ptr), block.size, " bytes");
}

}  // namespace

CudaAllocator& CudaAllocator::instance() {
  static CudaAllocator a;
  return a;
}

bool CudaAllocator::caching() {
  static const bool on = [] {
    const char* value = std::getenv("POLLEN_CUDA_NO_CACHING");
    if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0)
      return true;
    if (std::strcmp(value, "1") == 0) return false;
    fail("POLLEN_CUDA_NO_CACHING must be 1 (a cudaMalloc and cudaFree per tensor) or 0 (the ",
         "caching allocator), got '", value, "'");
  }();
  return on;
}

void* CudaAllocator::allocate(size_t bytes) {
  const int device = cuda::current_device();
  cudaStream_t stream = cuda::default_stream();
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!caching()) return allocate_uncached(s, bytes, device, stream);
  std::unique_ptr<BlockPool>& pool = s.pools[{device, stream}];
  if (!pool) pool = std::make_unique<BlockPool>(device_segments(device));
  const uint64_t segments = pool->segments_allocated();
  size_t size = 0;
  void* p = pool->allocate(bytes, &size);
  if (!p) {  // the cache's free segments back to the driver, then once more
    release_free_segments(s);
    p = pool->allocate(bytes, &size);
  }
  if (!p) fail_out_of_memory(s, device, bytes);
  s.owner.emplace(p, pool.get());
  s.stats.handed_out(size, reserved_bytes(s), pool->segments_allocated() != segments);
  return p;
}

void CudaAllocator::release(void* ptr) {
  if (!ptr) return;
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!caching()) return release_uncached(s, ptr);
  auto it = s.owner.find(ptr);
  POLLEN_ASSERT(it != s.owner.end());
  // Work already enqueued on the pool's stream may still use the block; the next user is on the
  // same stream, so it runs after that work.
  const size_t size = it->second->release(ptr);
  s.owner.erase(it);
  s.stats.given_back(size, reserved_bytes(s));
}

void CudaAllocator::empty_cache() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  release_free_segments(s);
}

AllocatorStats CudaAllocator::stats() const {
  std::lock_guard lock(state().mutex);
  return state().stats;
}

void CudaAllocator::reset_peak() {
  std::lock_guard lock(state().mutex);
  AllocatorStats& st = state().stats;
  st.peak_in_use_bytes = st.in_use_bytes;
  st.peak_reserved_bytes = st.in_use_bytes + st.cached_bytes;
}

namespace cuda {
namespace {

constexpr int kThreads = 256;

// Element of `bytes` bytes, copied as an unsigned integer of that size.
template <typename U>
__global__ void fill_kernel(U* dst, int64_t n, U pattern) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x)
    dst[i] = pattern;
}

template <typename U>
void launch_fill(void* dst, int64_t n, const void* pattern_bytes) {
  U pattern;
  std::memcpy(&pattern, pattern_bytes, sizeof(U));
  fill_kernel<U><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(static_cast<U*>(dst),
                                                                              n, pattern);
  POLLEN_CUDA_CHECK_LAUNCH("fill", "n=", n, " element bytes=", sizeof(U));
}

__device__ inline double to_double(double x) {
  return x;
}
__device__ inline double to_double(float x) {
  return x;
}
__device__ inline double to_double(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// As the host's store(): f64 -> f32 rounds once; -> bf16 goes through f32 (RNE both times).
template <typename D>
__device__ inline D from_double(double x);
template <>
__device__ inline double from_double<double>(double x) {
  return x;
}
template <>
__device__ inline float from_double<float>(double x) {
  return static_cast<float>(x);
}
template <>
__device__ inline __nv_bfloat16 from_double<__nv_bfloat16>(double x) {
  return __float2bfloat16(static_cast<float>(x));
}

template <typename S, typename D>
__global__ void convert_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x)
    dst[i] = from_double<D>(to_double(src[i]));
}

template <typename S, typename D>
void launch_convert(const void* src, void* dst, int64_t n) {
  convert_kernel<S, D><<<grid_blocks(n, kThreads), kThreads, 0, default_stream()>>>(
      static_cast<const S*>(src), static_cast<D*>(dst), n);
  POLLEN_CUDA_CHECK_LAUNCH("convert", "n=", n);
}

// Calls f(T{}) for the element types with conversion kernels; false for the others.
template <typename F>
bool with_float_type(DType t, F&& f) {
  switch (t) {
    case DType::f64:
      f(double{});
      return true;
    case DType::f32:
      f(float{});
      return true;
    case DType::bf16:
      f(__nv_bfloat16{});
      return true;
    default:
      return false;
  }
}

bool is_convertible(DType t) {
  return t == DType::f64 || t == DType::f32 || t == DType::bf16;
}

// The bytes of `value` stored as one element of dtype t, as the host's Tensor::fill_ stores it.
void element_bytes(DType t, double v, unsigned char* out) {
  auto put = [&](auto x) { std::memcpy(out, &x, sizeof(x)); };
  switch (t) {
    case DType::f64:
      put(v);
      break;
    case DType::f32:
      put(static_cast<float>(v));
      break;
    case DType::bf16:
      put(bf16::from_float(static_cast<float>(v)).bits);
      break;
    case DType::f16:
      put(f16::from_float(static_cast<float>(v)).bits);
      break;
    case DType::i64:
      put(static_cast<int64_t>(v));
      break;
    case DType::i32:
      put(static_cast<int32_t>(v));
      break;
    case DType::u32:
      put(static_cast<uint32_t>(v));
      break;
    case DType::u16:
      put(static_cast<uint16_t>(v));
      break;
    case DType::u8:
      put(static_cast<uint8_t>(v));
      break;
  }
}

}  // namespace

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  cudaStream_t stream = default_stream();
  // Unified addressing lets the runtime tell host from device pointers (cudaMemcpyDefault).
  POLLEN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "dst on ",
                    device_name(dst_device), ", src on ", device_name(src_device), ", ", bytes,
                    " bytes");
  if (dst_device == Device::cpu || src_device == Device::cpu)
    POLLEN_CUDA_CHECK(cudaStreamSynchronize(stream), "after a copy of ", bytes, " bytes to ",
                      device_name(dst_device), " from ", device_name(src_device));
}

void zero_bytes(void* dst, size_t bytes) {
  if (bytes == 0) return;
  POLLEN_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, default_stream()), bytes, " bytes");
}

void fill(void* dst, DType dtype, int64_t n, double value) {
  if (n == 0) return;
  unsigned char pattern[8];
  element_bytes(dtype, value, pattern);
  switch (dtype_size(dtype)) {
    case 1:
      launch_fill<uint8_t>(dst, n, pattern);
      break;
    case 2:
      launch_fill<uint16_t>(dst, n, pattern);
      break;
    case 4:
      launch_fill<uint32_t>(dst, n, pattern);
      break;
    default:
      launch_fill<uint64_t>(dst, n, pattern);
      break;
  }
}

bool convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  if (!is_convertible(src_dtype) || !is_convertible(dst_dtype)) return false;
  if (n == 0) return true;
  with_float_type(src_dtype, [&](auto s) {
    with_float_type(dst_dtype,
                    [&](auto d) { launch_convert<decltype(s), decltype(d)>(src, dst, n); });
  });
  return true;
}

void synchronize() {
  POLLEN_CUDA_CHECK(cudaStreamSynchronize(default_stream()), "device=", current_device());
}

void set_device(int device) {
  POLLEN_CUDA_CHECK(cudaSetDevice(device), "device=", device);
}

}  // namespace cuda
}  // namespace pollen
