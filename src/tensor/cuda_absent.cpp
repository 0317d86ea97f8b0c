// Built when the CUDA toolkit was not found: the CUDA device queries say so.
#include "tensor/device.h"

namespace pollen {
bool cuda_built() {
  return false;
}
std::vector<GpuInfo> cuda_devices() {
  return {};
}
std::string cuda_status() {
  return "CUDA backend not built (nvcc was not found at build time)";
}
}  // namespace pollen
