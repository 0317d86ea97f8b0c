#include "base/thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <memory>

#include "base/error.h"

namespace pollen {

ThreadPool::ThreadPool(int threads) {
  POLLEN_CHECK(threads >= 1, "thread count must be at least 1, got ", threads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

namespace {
// Set on a thread while it runs a chunk of a job (a worker always): a call it makes runs inline,
// as the pool is busy with the job that chunk belongs to.
thread_local bool in_chunk = false;

struct InChunk {
  bool was = in_chunk;
  InChunk() { in_chunk = true; }
  ~InChunk() { in_chunk = was; }
};
}  // namespace

void ThreadPool::run_chunks(int64_t n, int chunks,
                            const std::function<void(int64_t, int64_t, int)>& fn) {
  if (chunks <= 1 || workers_.empty() || in_chunk) {
    for (int c = 0; c < std::max(chunks, 1); ++c) {
      int total = std::max(chunks, 1);
      fn(n * c / total, n * (c + 1) / total, c);
    }
    return;
  }
  // Another thread's job (a server's HTTP thread beside its engine) waits for this one: the
  // pool holds one job at a time.
  std::lock_guard one_job(callers_);
  std::unique_lock lock(mutex_);
  job_ = &fn;
  job_n_ = n;
  job_chunks_ = chunks;
  next_chunk_ = 0;
  pending_ = chunks;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  // The caller works too, taking chunks until none are left.
  while (next_chunk_ < job_chunks_) {
    int c = next_chunk_++;
    lock.unlock();
    try {
      const InChunk inside;
      fn(n * c / chunks, n * (c + 1) / chunks, c);
    } catch (...) {
      std::lock_guard g(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    --pending_;
  }
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_loop(int) {
  in_chunk = true;  // a worker only ever runs chunks
  uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock,
               [&] { return stop_ || (generation_ != seen && job_ && next_chunk_ < job_chunks_); });
    if (stop_) return;
    seen = generation_;
    while (job_ && next_chunk_ < job_chunks_) {
      int c = next_chunk_++;
      const auto* fn = job_;
      int64_t n = job_n_;
      int chunks = job_chunks_;
      lock.unlock();
      try {
        (*fn)(n * c / chunks, n * (c + 1) / chunks, c);
      } catch (...) {
        std::lock_guard g(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

CpuMask affinity_mask() {
  CpuMask mask;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    for (size_t cpu = 0; cpu < mask.size() && cpu < std::thread::hardware_concurrency(); ++cpu)
      mask.set(cpu);
    return mask;
  }
  for (size_t cpu = 0; cpu < mask.size() && cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) mask.set(cpu);
  return mask;
}

int threads_per_rank(const CpuMask& mine, const std::vector<CpuMask>& node) {
  const auto sharing = std::count_if(node.begin(), node.end(),
                                     [&](const CpuMask& other) { return (other & mine).any(); });
  return std::max(1, static_cast<int>(mine.count()) / std::max<int>(1, static_cast<int>(sharing)));
}

namespace {
int default_threads() {
  return available_cpus();
}
std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> p = std::make_unique<ThreadPool>(default_threads());
  return p;
}
}  // namespace

ThreadPool& pool() {
  return *pool_slot();
}

void set_num_threads(int threads) {
  if (threads == num_threads()) return;
  pool_slot() = std::make_unique<ThreadPool>(threads);
}

int num_threads() {
  return pool().size();
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(grain, 1));
  int chunks = static_cast<int>(std::min<int64_t>(num_threads(), max_chunks));
  pool().run_chunks(n, chunks, [&](int64_t b, int64_t e, int) { fn(b, e); });
}

}  // namespace pollen
