#include "ops/profile.h"

#include <algorithm>
#include <chrono>

#include "base/error.h"
#include "tensor/cuda_event.h"

namespace pollen::ops {
namespace {

thread_local OpProfile* active_profile = nullptr;
thread_local int timer_depth = 0;  // OpTimers open on this thread under the active profile

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

OpProfile::OpProfile() {
  POLLEN_CHECK(active_profile == nullptr, "op profile: one is already active on this thread");
  active_profile = this;
}

OpProfile::~OpProfile() {
  active_profile = nullptr;
}

void OpProfile::add(const char* op, double ms) {
  Entry& e = totals_[op];
  e.op = op;
  e.calls += 1;
  e.ms += ms;
}

std::unique_ptr<::pollen::cuda::Event> OpProfile::spare_event() {
  if (spare_events_.empty()) return std::make_unique<::pollen::cuda::Event>();
  std::unique_ptr<::pollen::cuda::Event> e = std::move(spare_events_.back());
  spare_events_.pop_back();
  return e;
}

void OpProfile::settle() {
  for (GpuSpan& span : pending_) {
    add(span.op, span.end->ms_since(*span.start));
    spare_events_.push_back(std::move(span.start));
    spare_events_.push_back(std::move(span.end));
  }
  pending_.clear();
}

void OpProfile::reset() {
  settle();
  totals_.clear();
}

std::vector<OpProfile::Entry> OpProfile::entries() {
  settle();
  std::vector<Entry> out;
  for (const auto& [op, e] : totals_) out.push_back(e);
  std::stable_sort(out.begin(), out.end(),
                   [](const Entry& a, const Entry& b) { return a.ms > b.ms; });
  return out;
}

OpTimer::OpTimer(const char* name, const Tensor& on) : name_(name) {
  if (active_profile == nullptr) return;
  nested_ = true;
  if (timer_depth++ > 0) return;
  profile_ = active_profile;
  if (on.defined() && on.device() == Device::cuda) {
    try {
      span_.op = name;
      span_.start = profile_->spare_event();
      span_.end = profile_->spare_event();
      span_.start->record();
    } catch (const Error&) {
      --timer_depth;  // no destructor runs for a constructor that throws
      throw;
    }
  } else {
    start_ns_ = now_ns();
  }
}

OpTimer::~OpTimer() {
  if (nested_) --timer_depth;
  if (profile_ == nullptr || profile_ != active_profile) return;
  if (span_.start) {
    // A failing record drops this op's time: the GPU's error resurfaces at the next checked call,
    // and a destructor must not throw.
    try {
      span_.end->record();
      profile_->pending_.push_back(std::move(span_));
    } catch (const Error&) {
    }
  } else {
    profile_->add(name_, static_cast<double>(now_ns() - start_ns_) * 1e-6);
  }
}

}  // namespace pollen::ops
