// Built with the CUDA toolkit: asks the runtime which GPUs this process can see.
#include <cuda_runtime.h>

#include "base/log.h"
#include "tensor/device.h"

namespace pollen {

bool cuda_built() {
  return true;
}

std::vector<GpuInfo> cuda_devices() {
  std::vector<GpuInfo> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {  // no GPU usable: cuda_status() says why
    cudaGetLastError();
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    const cudaError_t err = cudaGetDeviceProperties(&p, i);
    if (err != cudaSuccess) {  // left out of the list, with the reason in the log
      cudaGetLastError();
      log::warn("cudaGetDeviceProperties(&p, ", i, ") failed: ", cudaGetErrorName(err), " (",
                cudaGetErrorString(err), "); GPU ", i, " is left out");
      continue;
    }
    out.push_back({i, p.name, p.totalGlobalMem, p.major, p.minor});
  }
  return out;
}

namespace {
// "13.0" from CUDA's 13000, or "unknown" when the query failed (its error cleared, so that the
// next launch check does not report it).
template <typename Query>
std::string cuda_version(Query query) {
  int version = 0;
  if (query(&version) != cudaSuccess) {
    cudaGetLastError();
    return "unknown";
  }
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}
}  // namespace

std::string cuda_status() {
  int count = 0;
  const std::string runtime = "runtime " + cuda_version(cudaRuntimeGetVersion);
  const std::string driver = "driver " + cuda_version(cudaDriverGetVersion);
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    std::string why = cudaGetErrorString(err);
    cudaGetLastError();  // cleared, as above
    return "CUDA backend built (" + runtime + "); no GPU usable: " + why;
  }
  return "CUDA backend built (" + runtime + ", " + driver + "); " + std::to_string(count) +
         " GPU(s)";
}

}  // namespace pollen
