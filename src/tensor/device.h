#pragma once
// Devices: the CPU, and CUDA GPUs when the backend is built in.
#include <string>
#include <vector>

namespace pollen {

enum class Device : uint8_t { cpu, cuda };

const char* device_name(Device d);
Device parse_device(const std::string& name);  // "cpu" or "cuda"; throws naming the value

struct GpuInfo {
  int index;
  std::string name;
  size_t memory_bytes;
  int compute_major, compute_minor;
};

bool cuda_built();                    // was the CUDA backend compiled in?
std::vector<GpuInfo> cuda_devices();  // GPUs the runtime sees (empty without CUDA or GPU)
std::string cuda_status();            // why there are none, or the runtime version
// Throws "<what>: device 'cuda' is not usable here: <cuda_status()>" when no GPU is usable.
void require_gpu(const std::string& what);

}  // namespace pollen
