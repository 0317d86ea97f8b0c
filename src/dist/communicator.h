#pragma once
// Collectives for data parallelism inside a silo. The trainer sees only this interface; a single
// process gets `SingleProcess` (every collective is a copy or nothing), a job launched by mpirun
// or srun gets the MPI one (mpi_communicator.h).
//
// Collectives are non-blocking: start one, keep computing, then wait(). Every wait runs under a
// watchdog: a collective that does not complete within the timeout (a peer died or hangs)
// throws PeerFailure naming the ranks that never reached it or stopped after it, since
// OpenMPI's collectives have no timeout of their own. Every rank must start the same
// collectives in the same order.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/error.h"
#include "dist/topology.h"

namespace pollen::dist {

// A peer died or hangs: a collective did not complete in time. Not recoverable in this job.
class PeerFailure : public Error {
 public:
  PeerFailure(const std::string& what, std::vector<int> missing)
      : Error(what), missing_(std::move(missing)) {}
  const std::vector<int>& missing_ranks() const { return missing_; }

 private:
  std::vector<int> missing_;
};

using Request = int64_t;  // a collective in flight

class Communicator {
 public:
  virtual ~Communicator() = default;
  int rank() const { return topology_.rank; }
  int world() const { return topology_.world; }
  const Topology& topology() const { return topology_; }

  // Buffers must stay alive and untouched until wait() returns. `what` names the collective in
  // a timeout's message ("gradient bucket 3").
  // Sum over ranks, in place: data[n].
  virtual Request start_all_reduce(float* data, int64_t n, std::string what) = 0;
  // Sum over ranks of in[world * n]; this rank receives block `rank` of the sum in out[n].
  virtual Request start_reduce_scatter(const float* in, float* out, int64_t n,
                                       std::string what) = 0;
  // Every rank's in[n] into out[world * n], in rank order.
  virtual Request start_all_gather(const float* in, float* out, int64_t n, std::string what) = 0;
  // The root's data[n] into every rank's data[n].
  virtual Request start_broadcast(float* data, int64_t n, int root, std::string what) = 0;
  // Lets collectives in flight advance (MPI moves them only inside its calls).
  virtual void progress() = 0;
  // Waits for one collective under the watchdog; returns the seconds spent waiting.
  virtual double wait(Request request) = 0;

  // Blocking sums and broadcasts of small values, under the watchdog.
  virtual void all_reduce_sum(std::span<double> values, std::string what) = 0;
  virtual void broadcast(std::span<int64_t> values, int root, std::string what) = 0;
  // The same broadcast waited for with no watchdog, as long as the root takes to start it: for
  // ranks that idle while the root waits on something outside the job (a federation server).
  virtual void wait_for_broadcast(std::span<int64_t> values, int root, std::string what) = 0;
  void barrier(std::string what);
  // Where every rank runs, as its launcher placed it (a collective; rank 0 logs it):
  // "0 on node1 (local 0 of 2), 1 on node1 (local 1 of 2), ...".
  std::string placement();
  // Threads for this rank when the run leaves them to pollen (a collective): its CPUs shared out
  // among the ranks of its node whose CPUs overlap its own (threads_per_rank).
  int threads_per_rank();

  // Ends every process of the job with this exit code (after a PeerFailure: the hung peer too).
  [[noreturn]] virtual void abort_job(int exit_code) = 0;

 protected:
  explicit Communicator(Topology topology) : topology_(std::move(topology)) {}
  Topology topology_;
};

// One process: collectives are copies, waits return at once.
class SingleProcess final : public Communicator {
 public:
  SingleProcess() : Communicator(Topology{}) {}
  Request start_all_reduce(float*, int64_t, std::string) override { return 0; }
  Request start_reduce_scatter(const float* in, float* out, int64_t n, std::string) override;
  Request start_all_gather(const float* in, float* out, int64_t n, std::string) override;
  Request start_broadcast(float*, int64_t, int, std::string) override { return 0; }
  void progress() override {}
  double wait(Request) override { return 0; }
  void all_reduce_sum(std::span<double>, std::string) override {}
  void broadcast(std::span<int64_t>, int, std::string) override {}
  void wait_for_broadcast(std::span<int64_t>, int, std::string) override {}
  [[noreturn]] void abort_job(int exit_code) override;
};

// The communicator this process's launcher calls for: SingleProcess when the environment names
// no job of several processes (no MPI is initialised then), else MPI with a watchdog of
// `timeout_s` seconds per collective.
std::unique_ptr<Communicator> connect(double timeout_s);

}  // namespace pollen::dist
