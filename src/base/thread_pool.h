#pragma once
// A fixed pool of worker threads with a deterministic parallel_for: the range is always cut into
// the same contiguous chunks for the same thread count, so results never depend on scheduling.
#include <bitset>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pollen {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end, chunk) for chunk i of `chunks` equal contiguous slices of [0, n).
  // The calling thread takes part; returns when every chunk is done. Exceptions propagate.
  // Calls from several threads take turns (one job at a time); a call from inside a chunk runs
  // its chunks on its own thread.
  void run_chunks(int64_t n, int chunks, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex callers_;  // held by the thread whose job the pool runs
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_chunks_ = 0;
  int next_chunk_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The CPUs this process may run on: its affinity mask (taskset, Slurm's --cpus-per-task,
// mpirun's binding), not every core of the machine.
int available_cpus();
// The CPUs this process may run on (its affinity mask).
using CpuMask = std::bitset<1024>;
CpuMask affinity_mask();
// Threads for a rank of a job that may run on `mine`, given the masks of the ranks on its node
// (its own among them): its CPUs shared out among the ranks whose CPUs overlap its own. Ranks
// bound apart (Slurm's --cpus-per-task, mpirun's --bind-to core) each get their own CPUs; ranks
// that share a mask (free to run anywhere, or one taskset or cgroup for all) get a share of it.
int threads_per_rank(const CpuMask& mine, const std::vector<CpuMask>& node);

// The process-wide pool used by ops; sized by set_num_threads (default: available_cpus()).
ThreadPool& pool();
void set_num_threads(int threads);
int num_threads();

// parallel_for over [0, n) in num_threads() contiguous chunks (fewer when n is small or when
// each chunk would be under `grain` items). fn(begin, end).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace pollen
