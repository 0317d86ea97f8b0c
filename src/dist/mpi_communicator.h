#pragma once
// The CPU path of data parallelism: OpenMPI's non-blocking collectives (MPI_Iallreduce,
// MPI_Ireduce_scatter_block, MPI_Iallgather) on float buffers, each waited for under a watchdog.
//
// Naming a failed peer: whenever this rank starts a collective it tells every peer its sequence
// number (a one-integer message on a communicator of its own), and it keeps a receive posted
// from every peer. A wait that passes the timeout names the peers whose last sequence number is
// behind the collective's (they died or hang before reaching it) or behind the latest one this
// rank started (they reached it, then stopped calling MPI, which it needs to finish: a gradient
// bucket started before a rank hangs in the rest of its backward). Reduction order is MPI's,
// which depends only on the message size and the world size, so a run at a given world size is
// repeatable.
// MPI's C API only: OpenMPI's deprecated C++ bindings are not linked.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <map>
#include <memory>
#include <vector>

#include "dist/communicator.h"

namespace pollen::dist {

class MpiCommunicator final : public Communicator {
 public:
  // Initialises MPI (funneled: only the calling thread talks to MPI) and checks that MPI's rank
  // and size agree with the launcher's environment.
  MpiCommunicator(const Topology& topology, double timeout_s);
  // Drains the arrival messages, then MPI_Finalize; while an exception unwinds, aborts the job
  // with exit code 1 instead.
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  Request start_all_reduce(float* data, int64_t n, std::string what) override;
  Request start_reduce_scatter(const float* in, float* out, int64_t n, std::string what) override;
  Request start_all_gather(const float* in, float* out, int64_t n, std::string what) override;
  Request start_broadcast(float* data, int64_t n, int root, std::string what) override;
  void progress() override;
  double wait(Request request) override;
  void all_reduce_sum(std::span<double> values, std::string what) override;
  void broadcast(std::span<int64_t> values, int root, std::string what) override;
  void wait_for_broadcast(std::span<int64_t> values, int root, std::string what) override;
  [[noreturn]] void abort_job(int exit_code) override;

 private:
  struct InFlight {
    MPI_Request request = MPI_REQUEST_NULL;
    int64_t seq = 0;
    std::string what;
  };
  struct Notice {
    MPI_Request request = MPI_REQUEST_NULL;
    std::unique_ptr<int64_t> seq;  // the send buffer lives until the send completes
  };
  Request track(MPI_Request request, std::string what);
  Request start_broadcast(std::span<int64_t> values, int root, std::string what);
  // wait() with a watchdog of timeout_s (infinity: none).
  double wait_within(Request request, double timeout_s);
  // The failure of `f`, which did not complete within timeout_s, naming the peers to blame.
  PeerFailure timed_out(const InFlight& f, double timeout_s) const;
  int count(int64_t n) const;  // MPI's int count, checked
  void announce();             // tells every peer this rank reached collective seq_
  void poll_arrivals();
  void check(int mpi_error, const std::string& what) const;

  double timeout_s_;
  bool initialised_here_ = false;
  MPI_Comm collectives_ = MPI_COMM_NULL, arrivals_ = MPI_COMM_NULL;
  int64_t seq_ = 0;
  Request next_request_ = 1;
  std::map<Request, InFlight> in_flight_;
  std::vector<Notice> sent_;
  std::vector<MPI_Request> arrival_recv_;
  std::vector<int64_t> arrival_buf_, last_arrival_;
};

}  // namespace pollen::dist
