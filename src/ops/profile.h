#pragma once
// Where a training step's time goes, op by op. While an OpProfile is active on a thread, every op
// of src/ops called on that thread is timed under its name ("gemm", "attention_backward", ...);
// an op called from inside another counts in the outer one. On the CPU an op's time is the wall
// time of its call; on a GPU it is the GPU time between two events recorded on the default
// stream around the work it enqueued, so profiling never waits for the GPU until settle().
// What no op covers (tensor copies and fills, host work between ops, GPU idle time) is the step's
// time minus the ops' sum.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace pollen::cuda {
class Event;
}

namespace pollen::ops {

class OpProfile {
 public:
  struct Entry {
    std::string op;
    int64_t calls = 0;
    double ms = 0;  // summed over the calls
  };

  OpProfile();  // active on the calling thread until destroyed; at most one per thread
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Adds the ops timed since the last settle() to the totals; waits for the GPU's events.
  void settle();
  void reset();                  // settles, then forgets the totals (the warm-up steps' ops)
  std::vector<Entry> entries();  // settles; the ops by time spent, most first

 private:
  friend class OpTimer;
  struct GpuSpan {
    const char* op;
    std::unique_ptr<::pollen::cuda::Event> start, end;
  };
  void add(const char* op, double ms);
  std::unique_ptr<::pollen::cuda::Event> spare_event();

  std::map<std::string, Entry> totals_;
  std::vector<GpuSpan> pending_;                                      // recorded, not yet read
  std::vector<std::unique_ptr<::pollen::cuda::Event>> spare_events_;  // read, to be recorded again
};

// Times its scope as op `name` (a string literal) when a profile is active on this thread and
// no other OpTimer encloses it; on the GPU when `on` (a tensor of the op's) lives there.
class OpTimer {
 public:
  OpTimer(const char* name, const Tensor& on);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  OpProfile* profile_ = nullptr;  // the active profile when this timer is the outermost
  bool nested_ = false;           // entered under an active profile (counted in the depth)
  const char* name_;
  int64_t start_ns_ = 0;     // CPU
  OpProfile::GpuSpan span_;  // GPU
};

}  // namespace pollen::ops
