// Streams that stop moving are cancelled. A blocking gRPC read or write takes no deadline of its
// own (a whole-call deadline would cut a large model's transfer short), so each watched stream
// reports its progress, and one that has not moved for its limit is cancelled: its cancel
// function (ClientContext or ServerContext TryCancel) runs once, on the watch's own thread, and
// the blocked read or write returns.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace pollen::fed {

class StallWatch {
 public:
  StallWatch();
  ~StallWatch();
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

  // One watched stream, watched from its creation until it is destroyed.
  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    void moved();            // waiting on the peer from now: the limit counts from here
    void hold();             // this side is working, not waiting: not watched until moved()
    bool cancelled() const;  // the stream was cancelled for standing still

   private:
    friend class StallWatch;
    Ticket(StallWatch& watch, uint64_t id) : watch_(watch), id_(id) {}
    StallWatch& watch_;
    uint64_t id_;
  };

  // Watches a stream that may stand still for at most `limit_s` seconds at a time (at most
  // kMaxLimitS: a longer one would overflow the clock).
  static constexpr double kMaxLimitS = 1e9;
  std::unique_ptr<Ticket> watch(double limit_s, std::function<void()> cancel);

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    Clock::time_point last_moved;
    Clock::duration limit;
    std::function<void()> cancel;
    bool held = false;
    bool cancelled = false;
  };
  void run();

  mutable std::mutex mutex_;  // held while a cancel function runs: a ticket outlives its call
  std::condition_variable wake_;
  std::map<uint64_t, Entry> entries_;
  uint64_t next_id_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace pollen::fed
