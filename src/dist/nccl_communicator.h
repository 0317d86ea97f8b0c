#pragma once
// The GPU path of data parallelism: NCCL's collectives on f32 GPU buffers (dist/nccl.h), each
// waited for under a watchdog, beside the launcher's communicator (MPI, or one process), which
// carries the NCCL rendezvous and the small host-side sums and broadcasts.
//
// Each rank drives one GPU: rank r takes local GPU (local rank), or the one GPU it sees, so a node
// runs as many ranks as it has GPUs. Collectives run on NCCL's own stream after the work the
// default stream had enqueued before them (the copies into a gradient bucket), so a bucket is
// summed while the default stream goes on with backward; wait() polls an event recorded after
// it. A wait past the timeout aborts the NCCL communicator and asks the
// launcher's communicator which ranks are still there: its own watchdog names a dead or hung
// peer.
#include <cstdlib>
#include <map>

#include "dist/communicator.h"
#include "dist/nccl.h"

namespace pollen::dist {

class NcclCommunicator final : public Communicator {
 public:
  // Selects this rank's GPU (its local rank; refused when the node has fewer GPUs than ranks),
  // then joins NCCL with the unique id rank 0 makes and `host` broadcasts. A collective of host.
  NcclCommunicator(Communicator& host, double timeout_s);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // GPU buffers.
  Request start_all_reduce(float* data, int64_t n, std::string what) override;
  Request start_reduce_scatter(const float* in, float* out, int64_t n, std::string what) override;
  Request start_all_gather(const float* in, float* out, int64_t n, std::string what) override;
  Request start_broadcast(float* data, int64_t n, int root, std::string what) override;
  void progress() override { host_.progress(); }
  double wait(Request request) override;
  // Host values, through the launcher's communicator.
  void all_reduce_sum(std::span<double> values, std::string what) override {
    host_.all_reduce_sum(values, std::move(what));
  }
  void broadcast(std::span<int64_t> values, int root, std::string what) override {
    host_.broadcast(values, root, std::move(what));
  }
  void wait_for_broadcast(std::span<int64_t> values, int root, std::string what) override {
    host_.wait_for_broadcast(values, root, std::move(what));
  }
  [[noreturn]] void abort_job(int exit_code) override {
    host_.abort_job(exit_code);
    std::abort();  // not reached: a virtual call does not carry [[noreturn]] to the compiler
  }

 private:
  Request track(std::string what);
  void check_usable() const;  // NCCL not aborted by an earlier failure

  Communicator& host_;
  double timeout_s_;
  nccl::Comm* comm_ = nullptr;
  Request next_request_ = 1;
  struct InFlight {
    nccl::Event* event = nullptr;
    std::string what;
  };
  std::map<Request, InFlight> in_flight_;
};

}  // namespace pollen::dist
