#pragma once
// GPU memory for tensors, for code that does not include CUDA's headers. Device memory comes
// from a caching allocator: a BlockPool per (GPU, stream) over cudaMalloc'd segments hands freed
// blocks out again to the next request on that stream, split and merged, so a training loop
// stops calling cudaMalloc after step one and memory freed in one shape serves another. Every GPU
// has one default stream (created at first use); all of pollen's GPU work on that GPU runs in order
// on it.
//
// POLLEN_CUDA_NO_CACHING=1 (read once) turns the caching off, for memory checkers: every tensor
// gets its own cudaMalloc and its release a cudaFree, after its stream has finished, as PyTorch's
// PYTORCH_NO_CUDA_MEMORY_CACHING=1 does. compute-sanitizer's memcheck then sees each tensor's
// bounds; inside a pooled segment an overrun lands in a neighbouring block, which it cannot tell
// from a valid access. Slow: for checking only. The stats stay meaningful: bytes in use and their
// peak as with caching, nothing cached, and each tensor counted as a segment from the driver.
//
// "The GPU" is the current CUDA device of the calling thread (device 0 unless changed).
// In a build without the CUDA backend every function here throws, naming the missing backend.
#include <cstddef>
#include <cstdint>

#include "tensor/allocator.h"
#include "tensor/block_pool.h"
#include "tensor/device.h"
#include "tensor/dtype.h"

namespace pollen {

class CudaAllocator {
 public:
  static CudaAllocator& instance();
  // On the current GPU, for its default stream, from that pair's BlockPool over cudaMalloc'd
  // segments; bytes rounded up to a multiple of 512.
  void* allocate(size_t bytes);
  void release(void* ptr);  // back to the pool of its GPU and stream
  void empty_cache();  // waits for the GPUs, then returns every wholly free segment to the driver
  AllocatorStats stats() const;  // over all GPUs
  void reset_peak();

  static size_t size_class(size_t bytes) { return BlockPool::rounded(bytes); }
  // False when POLLEN_CUDA_NO_CACHING=1 (above); throws naming the variable when it is set to
  // anything but 1, 0 or empty.
  static bool caching();
};

namespace cuda {

// Copies bytes between host and GPU memory, or within the GPU, in order on the default stream.
// Returns once the copy is done whenever host memory takes part; a GPU-to-GPU copy is only
// enqueued.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Enqueue on the default stream: bytes of zeros; n elements of `dtype` set to value (converted
// as Tensor::fill_ converts it on the host).
void zero_bytes(void* dst, size_t bytes);
void fill(void* dst, DType dtype, int64_t n, double value);

// Enqueues dst[i] = src[i] converted, for n elements, when a kernel exists for the pair (f64,
// f32, bf16 in any direction); returns false otherwise (the caller converts on the host).
bool convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);

// Waits until the current GPU's default stream has finished; reports any asynchronous error.
void synchronize();

// Makes GPU `device` the calling thread's current one (a data-parallel rank's own GPU).
void set_device(int device);

}  // namespace cuda
}  // namespace pollen
