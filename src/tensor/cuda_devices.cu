// Built with the CUDA toolkit: asks the runtime which GPUs this process can see.
#include <cuda_runtime.h>

#include "tensor/device.h"

namespace pollen {

bool cuda_built() {
  return true;
}

std::vector<GpuInfo> cuda_devices() {
  std::vector<GpuInfo> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    out.push_back({i, p.name, p.totalGlobalMem, p.major, p.minor});
  }
  return out;
}

std::string cuda_status() {
  int runtime = 0, driver = 0, count = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  cudaError_t err = cudaGetDeviceCount(&count);
  std::string versions =
      "runtime " + std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
  if (err != cudaSuccess) {
    std::string why = cudaGetErrorString(err);
    cudaGetLastError();
    return "CUDA backend built (" + versions + "); no GPU usable: " + why;
  }
  return "CUDA backend built (" + versions + ", driver " + std::to_string(driver / 1000) + "." +
         std::to_string(driver % 1000 / 10) + "); " + std::to_string(count) + " GPU(s)";
}

}  // namespace pollen
