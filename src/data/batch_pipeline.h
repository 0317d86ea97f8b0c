#pragma once
// Batches of documents through three stages: filled by the caller (reading), worked on by the
// thread pool, merged by one thread in the order they were submitted. With more than one
// thread the stages overlap: the caller reads batch k+2 while the pool works on batch k+1 and
// the merge thread consumes batch k. With one thread they run one after the other on the
// caller's thread. Either way the merge sees the same batches in the same order, so what it
// produces does not depend on the thread count. At most `depth` batches exist (memory stays
// bounded) and they are reused, keeping their buffers.
#include <pthread.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "base/thread_pool.h"

namespace pollen::data {

template <class Batch>
class BatchPipeline {
 public:
  using Stage = std::function<void(Batch&)>;

  BatchPipeline(Stage work, Stage merge, int depth = 3)
      : work_(std::move(work)), merge_(std::move(merge)), overlap_(num_threads() > 1) {
    for (int i = 0; i < (overlap_ ? depth : 1); ++i) {
      batches_.push_back(std::make_unique<Batch>());
      free_.push_back(batches_.back().get());
    }
    current_ = free_.front();
    free_.pop_front();
    if (overlap_) {
      work_thread_ = std::thread([this] {
        pthread_setname_np(pthread_self(), "pollen-process");
        run_stage(filled_, worked_, work_);
      });
      merge_thread_ = std::thread([this] {
        pthread_setname_np(pthread_self(), "pollen-merge");
        run_stage(worked_, free_, merge_);
      });
    }
  }
  // Stops the stage threads without waiting for the batches in flight (after an error).
  ~BatchPipeline() {
    {
      std::lock_guard lock(mutex_);
      aborted_ = true;
    }
    changed_.notify_all();
    join();
  }
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;

  // The batch the caller fills. It may hold an earlier batch's contents: clear it first.
  Batch& batch() { return *current_; }

  // Hands the filled batch on and makes another one current. Throws the error of a stage.
  void submit() {
    if (!overlap_) {
      work_(*current_);
      merge_(*current_);
      return;
    }
    std::unique_lock lock(mutex_);
    filled_.push_back(current_);
    changed_.notify_all();
    changed_.wait(lock, [&] { return !free_.empty() || error_; });
    if (error_) {
      lock.unlock();
      rethrow();
    }
    current_ = free_.front();
    free_.pop_front();
  }

  // Waits until every submitted batch is merged; throws the error of a stage.
  void finish() {
    if (!overlap_) return;
    {
      std::lock_guard lock(mutex_);
      filled_.push_back(nullptr);  // the end
    }
    changed_.notify_all();
    rethrow();
  }

 private:
  void run_stage(std::deque<Batch*>& in, std::deque<Batch*>& out, const Stage& fn) {
    while (true) {
      Batch* b = nullptr;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return !in.empty() || error_ || aborted_; });
        if (error_ || aborted_) return;
        b = in.front();
        in.pop_front();
      }
      if (b) {
        try {
          fn(*b);
        } catch (...) {
          std::lock_guard lock(mutex_);
          if (!error_) error_ = std::current_exception();
          changed_.notify_all();
          return;
        }
      }
      {
        std::lock_guard lock(mutex_);
        out.push_back(b);
      }
      changed_.notify_all();
      if (!b) return;
    }
  }
  void join() {
    if (work_thread_.joinable()) work_thread_.join();
    if (merge_thread_.joinable()) merge_thread_.join();
  }
  void rethrow() {
    join();
    if (error_) std::rethrow_exception(error_);
  }

  Stage work_, merge_;
  const bool overlap_;
  std::vector<std::unique_ptr<Batch>> batches_;
  Batch* current_ = nullptr;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Batch*> free_, filled_, worked_;
  std::exception_ptr error_;
  bool aborted_ = false;
  std::thread work_thread_, merge_thread_;
};

}  // namespace pollen::data
