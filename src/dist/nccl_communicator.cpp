#include "dist/nccl_communicator.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "tensor/cuda_memory.h"
#include "tensor/device.h"

namespace pollen::dist {
namespace {

using Clock = std::chrono::steady_clock;

// The unique id as the int64 words the launcher's broadcast carries.
constexpr size_t kIdWords = sizeof(nccl::UniqueId) / sizeof(int64_t);
static_assert(kIdWords * sizeof(int64_t) == sizeof(nccl::UniqueId));

}  // namespace

NcclCommunicator::NcclCommunicator(Communicator& host, double timeout_s)
    : Communicator(host.topology()), host_(host), timeout_s_(timeout_s) {
  POLLEN_CHECK(timeout_s > 0, "parallel.timeout_s: expected a positive number of seconds");
  POLLEN_CHECK(nccl::built(), "data parallelism on GPUs needs NCCL: this pollen was built ",
               "without it (docs/parallel.md)");
  const int gpus = static_cast<int>(cuda_devices().size());
  const Topology& t = host.topology();
  // A rank that sees one GPU (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES) takes it.
  POLLEN_CHECK(gpus == 1 || t.local_rank < gpus, "rank ", t.rank, " is local rank ", t.local_rank,
               " of ", t.local_world, " on its node, which has ", gpus,
               " usable GPU(s): run one rank per GPU (", cuda_status(), ")");
  cuda::set_device(gpus == 1 ? 0 : t.local_rank);
  int64_t words[kIdWords] = {};
  if (t.rank == 0) {
    const nccl::UniqueId id = nccl::make_unique_id();
    std::memcpy(words, id.data(), id.size());
  }
  host_.broadcast(words, 0, "NCCL's unique id");
  nccl::UniqueId id;
  std::memcpy(id.data(), words, id.size());
  comm_ = nccl::init(id, t.world, t.rank);
}

NcclCommunicator::~NcclCommunicator() {
  for (auto& [request, f] : in_flight_) nccl::destroy(f.event);
  if (std::uncaught_exceptions() > 0) {
    nccl::abort(comm_);  // peers may never finish what this rank left in flight
  } else {
    nccl::destroy(comm_);
  }
}

Request NcclCommunicator::track(std::string what) {
  const Request r = next_request_++;
  in_flight_[r] = InFlight{nccl::record(comm_), std::move(what)};
  return r;
}

void NcclCommunicator::check_usable() const {
  POLLEN_CHECK(comm_ != nullptr, "rank ", rank(), ": NCCL was aborted after a failed collective; ",
               "this job cannot go on");
}

Request NcclCommunicator::start_all_reduce(float* data, int64_t n, std::string what) {
  check_usable();
  nccl::all_reduce_sum(comm_, data, n);
  return track(std::move(what));
}

Request NcclCommunicator::start_reduce_scatter(const float* in, float* out, int64_t n,
                                               std::string what) {
  check_usable();
  nccl::reduce_scatter_sum(comm_, in, out, n);
  return track(std::move(what));
}

Request NcclCommunicator::start_all_gather(const float* in, float* out, int64_t n,
                                           std::string what) {
  check_usable();
  nccl::all_gather(comm_, in, out, n);
  return track(std::move(what));
}

Request NcclCommunicator::start_broadcast(float* data, int64_t n, int root, std::string what) {
  check_usable();
  nccl::broadcast(comm_, data, n, root);
  return track(std::move(what));
}

double NcclCommunicator::wait(Request request) {
  const auto it = in_flight_.find(request);
  POLLEN_ASSERT(it != in_flight_.end());
  InFlight f = std::move(it->second);
  in_flight_.erase(it);
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::duration<double>(timeout_s_);
  for (int64_t polls = 0;; ++polls) {
    bool finished = false;
    try {
      finished = nccl::done(f.event);
    } catch (...) {
      nccl::destroy(f.event);
      throw;
    }
    if (finished) break;
    const std::string error = nccl::async_error(comm_);
    if (!error.empty() || Clock::now() > deadline) {
      nccl::destroy(f.event);
      nccl::abort(comm_);
      comm_ = nullptr;
      const std::string why =
          error.empty() ? cat("did not complete within ", timeout_s_, " s (parallel.timeout_s)")
                        : cat("failed: ", error);
      // The launcher's watchdog names a peer that never reaches this check.
      double alive[1] = {1.0};
      host_.all_reduce_sum(alive, cat("the check of which ranks remain after ", f.what, " ", why));
      throw PeerFailure(cat("rank ", rank(), ": ", f.what, " on the GPU ", why,
                            "; every rank reached the check after it, so one hangs inside NCCL"),
                        {});
    }
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 20 : 200));
    }
  }
  nccl::destroy(f.event);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace pollen::dist
