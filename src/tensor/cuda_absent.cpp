// Built when the CUDA toolkit was not found: the CUDA device queries say so, and GPU memory is
// refused with the same reason.
#include "base/error.h"
#include "tensor/cuda_event.h"
#include "tensor/cuda_memory.h"
#include "tensor/device.h"

namespace pollen {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  fail(what,
       ": device 'cuda' is not available: this pollen was built without the CUDA backend "
       "(nvcc was not found at build time)");
}
}  // namespace

bool cuda_built() {
  return false;
}
std::vector<GpuInfo> cuda_devices() {
  return {};
}
std::string cuda_status() {
  return "CUDA backend not built (nvcc was not found at build time)";
}

CudaAllocator& CudaAllocator::instance() {
  static CudaAllocator a;
  return a;
}
void* CudaAllocator::allocate(size_t) {
  no_cuda("GPU allocation");
}
bool CudaAllocator::caching() {
  return true;  // nothing to cache without GPUs; the setting is not read
}
void CudaAllocator::release(void*) {}
void CudaAllocator::empty_cache() {}
AllocatorStats CudaAllocator::stats() const {
  return {};
}
void CudaAllocator::reset_peak() {}

namespace cuda {
void copy_bytes(void*, Device, const void*, Device, size_t) {
  no_cuda("copy");
}
void zero_bytes(void*, size_t) {
  no_cuda("zero_");
}
void fill(void*, DType, int64_t, double) {
  no_cuda("fill_");
}
bool convert(const void*, DType, void*, DType, int64_t) {
  no_cuda("convert");
}
void synchronize() {
  no_cuda("synchronize");
}
void set_device(int) {
  no_cuda("set_device");
}

Event::Event() {
  no_cuda("timing event");
}
Event::~Event() = default;
void Event::record() {}
float Event::ms_since(const Event&) const {
  return 0;
}
}  // namespace cuda
}  // namespace pollen
