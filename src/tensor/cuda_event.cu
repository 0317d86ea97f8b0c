// Timing events on the default stream (tensor/cuda_event.h).
#include "tensor/cuda_context.h"
#include "tensor/cuda_event.h"

namespace pollen::cuda {

Event::Event() {
  cudaEvent_t e = nullptr;
  POLLEN_CUDA_CHECK(cudaEventCreate(&e), "device=", current_device());
  event_ = e;
}

Event::~Event() {
  POLLEN_CUDA_WARN(cudaEventDestroy(static_cast<cudaEvent_t>(event_)), "a timing event");
}

void Event::record() {
  POLLEN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), default_stream()),
                    "device=", current_device());
}

float Event::ms_since(const Event& start) const {
  POLLEN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "");
  float ms = 0;
  POLLEN_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_),
                                         static_cast<cudaEvent_t>(event_)),
                    "");
  return ms;
}

}  // namespace pollen::cuda
