#include "tensor/device.h"

#include "base/error.h"

namespace pollen {

const char* device_name(Device d) {
  return d == Device::cpu ? "cpu" : "cuda";
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::cpu;
  if (name == "cuda") {
    POLLEN_CHECK(cuda_built(),
                 "device 'cuda' is not available: this pollen was built without the CUDA backend "
                 "(nvcc was not found at build time)");
    return Device::cuda;
  }
  fail("unknown device '", name, "': expected cpu or cuda");
}

void require_gpu(const std::string& what) {
  POLLEN_CHECK(!cuda_devices().empty(), what,
               ": device 'cuda' is not usable here: ", cuda_status());
}

}  // namespace pollen
