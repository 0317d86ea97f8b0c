#include "fed/stall_watch.h"

#include <algorithm>

namespace pollen::fed {

StallWatch::StallWatch() : thread_([this] { run(); }) {}

StallWatch::~StallWatch() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::unique_ptr<StallWatch::Ticket> StallWatch::watch(double limit_s,
                                                      std::function<void()> cancel) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    id = ++next_id_;
    entries_[id] = {Clock::now(),
                    std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(std::clamp(limit_s, 0.0, kMaxLimitS))),
                    std::move(cancel)};
  }
  wake_.notify_all();  // its deadline may come before the one the thread waits for
  return std::unique_ptr<Ticket>(new Ticket(*this, id));
}

StallWatch::Ticket::~Ticket() {
  std::lock_guard lock(watch_.mutex_);
  watch_.entries_.erase(id_);
}

void StallWatch::Ticket::moved() {
  std::lock_guard lock(watch_.mutex_);
  Entry& e = watch_.entries_.at(id_);
  e.last_moved = Clock::now();
  e.held = false;
}

void StallWatch::Ticket::hold() {
  std::lock_guard lock(watch_.mutex_);
  watch_.entries_.at(id_).held = true;
}

bool StallWatch::Ticket::cancelled() const {
  std::lock_guard lock(watch_.mutex_);
  return watch_.entries_.at(id_).cancelled;
}

void StallWatch::run() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    const auto now = Clock::now();
    auto next = now + std::chrono::seconds(1);
    for (auto& [id, e] : entries_) {
      if (e.cancelled || e.held) continue;
      const auto deadline = e.last_moved + e.limit;
      if (deadline <= now) {
        e.cancelled = true;
        e.cancel();
      } else {
        next = std::min(next, deadline);
      }
    }
    wake_.wait_until(lock, next);
  }
}

}  // namespace pollen::fed
