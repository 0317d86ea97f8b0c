#pragma once
// For CUDA sources (.cu) only: checked CUDA calls and the current GPU's default stream.
//
//   POLLEN_CUDA_CHECK(cudaMalloc(&p, bytes), "bytes=", bytes);
// throws pollen::Error "cudaMalloc(&p, bytes) [bytes=1048576] failed: cudaErrorMemoryAllocation
// (out of memory) at src/tensor/cuda_memory.cu:57". After a kernel launch,
//   POLLEN_CUDA_CHECK_LAUNCH("rmsnorm_forward", "n=", n, " c=", c);
// reports launch errors (bad configuration, no kernel image for this GPU) the same way. In
// destructors and cleanup, where throwing would end the process or hide the error being handled,
//   POLLEN_CUDA_WARN(cudaEventDestroy(e), "device=", device);
// writes the same message as a warning (log::warn) instead.
#include <cuda_runtime.h>

#include <string>

#include "base/error.h"

namespace pollen::cuda {

[[noreturn]] void fail_call(cudaError_t err, const char* call, const std::string& args,
                            const char* file, int line);
// As fail_call, but writes the message as a warning and returns.
void warn_call(cudaError_t err, const char* call, const std::string& args, const char* file,
               int line);

int current_device();           // checked cudaGetDevice
cudaStream_t default_stream();  // of the current GPU, created (non-blocking) at first use

// Blocks of `threads` for a grid-stride loop over n elements, capped (the loop covers the rest).
inline unsigned grid_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace pollen::cuda

#define POLLEN_CUDA_CHECK(call, ...)                                                           \
  do {                                                                                         \
    const cudaError_t pollen_cuda_err_ = (call);                                               \
    if (pollen_cuda_err_ != cudaSuccess)                                                       \
      ::pollen::cuda::fail_call(pollen_cuda_err_, #call, ::pollen::cat(__VA_ARGS__), __FILE__, \
                                __LINE__);                                                     \
  } while (0)

#define POLLEN_CUDA_WARN(call, ...)                                                            \
  do {                                                                                         \
    const cudaError_t pollen_cuda_err_ = (call);                                               \
    if (pollen_cuda_err_ != cudaSuccess)                                                       \
      ::pollen::cuda::warn_call(pollen_cuda_err_, #call, ::pollen::cat(__VA_ARGS__), __FILE__, \
                                __LINE__);                                                     \
  } while (0)

#define POLLEN_CUDA_CHECK_LAUNCH(kernel, ...) \
  POLLEN_CUDA_CHECK(cudaGetLastError(), "launch of " kernel ": ", __VA_ARGS__)
