#include "dist/mpi_communicator.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

#include "base/log.h"

namespace pollen::dist {
namespace {

constexpr int kArrivalTag = 17;
using Clock = std::chrono::steady_clock;

// "rank 1", "ranks 1, 2".
std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// Busy-polls briefly, then sleeps between polls so that waiting ranks leave the cores to the
// ones still computing (several ranks may share a core).
void pause_between_polls(int64_t polls) {
  if (polls < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 20 : 200));
  }
}

// MPI_Init returns only once every rank of the job has called it: a rank that stalls before it
// (a hung file system, a node that never started it) would hold the others there for good, before
// any collective's watchdog runs. This one ends the waiting rank with exit code 4, as a hung
// collective does; mpirun then ends the rest.
void init_mpi_within(const Topology& t, double timeout_s) {
  std::mutex m;
  std::condition_variable cv;
  bool started = false;
  std::thread watchdog([&] {
    std::unique_lock lock(m);
    const auto limit = std::chrono::duration<double>(std::min(timeout_s, 1e8));
    if (cv.wait_for(lock, limit, [&] { return started; })) return;
    log::error("rank ", t.rank, ": MPI did not start within ", timeout_s,
               " s (parallel.timeout_s): a rank of the ", t.world,
               " did not reach MPI_Init (hung or never started); stopping the job. Rerun it "
               "with --resume once every rank can start");
    std::_Exit(4);
  });
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  {
    std::lock_guard lock(m);
    started = true;
  }
  cv.notify_one();
  watchdog.join();
}

}  // namespace

MpiCommunicator::MpiCommunicator(const Topology& topology, double timeout_s)
    : Communicator(topology), timeout_s_(timeout_s) {
  POLLEN_CHECK(timeout_s > 0, "parallel.timeout_s: expected a positive number of seconds");
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    init_mpi_within(topology, timeout_s);
    initialised_here_ = true;
  }
  int size = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  POLLEN_CHECK(size == topology.world && rank == topology.rank, "MPI says rank ", rank, " of ",
               size, " but the launcher's environment (", topology.launcher, ") says rank ",
               topology.rank, " of ", topology.world,
               "; under Slurm launch with srun --mpi=pmix (docs/parallel.md)");
  MPI_Comm_dup(MPI_COMM_WORLD, &collectives_);
  MPI_Comm_dup(MPI_COMM_WORLD, &arrivals_);
  MPI_Comm_set_errhandler(collectives_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(arrivals_, MPI_ERRORS_RETURN);
  // OpenMPI raises an error of a non-blocking collective's inner requests on MPI_COMM_WORLD,
  // whose default handler aborts before check() could name the failure.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const auto w = static_cast<size_t>(size);
  arrival_recv_.assign(w, MPI_REQUEST_NULL);
  arrival_buf_.assign(w, 0);
  last_arrival_.assign(w, 0);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    MPI_Irecv(&arrival_buf_[static_cast<size_t>(p)], 1, MPI_INT64_T, p, kArrivalTag, arrivals_,
              &arrival_recv_[static_cast<size_t>(p)]);
  }
}

MpiCommunicator::~MpiCommunicator() {
  // An error on this rank alone (the others wait in a collective it will never start) ends the
  // job; the error itself was reported on the way here.
  if (std::uncaught_exceptions() > 0) abort_job(1);
  try {
    // Every rank has started the same collectives, so after a barrier every peer's notices are
    // on their way: receive them all, then nothing is left unmatched at MPI_Finalize.
    barrier("the end of the run");
    for (int p = 0; p < world(); ++p) {
      const auto i = static_cast<size_t>(p);
      while (p != rank() && last_arrival_[i] < seq_) poll_arrivals();
      if (arrival_recv_[i] != MPI_REQUEST_NULL) {
        MPI_Cancel(&arrival_recv_[i]);
        MPI_Wait(&arrival_recv_[i], MPI_STATUS_IGNORE);
      }
    }
    for (auto& n : sent_) MPI_Wait(&n.request, MPI_STATUS_IGNORE);
  } catch (const Error& e) {
    log::error("rank ", rank(), ": ", e.what());
    abort_job(4);
  }
  MPI_Comm_free(&collectives_);
  MPI_Comm_free(&arrivals_);
  if (initialised_here_) MPI_Finalize();
}

void MpiCommunicator::check(int mpi_error, const std::string& what) const {
  if (mpi_error == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(mpi_error, text, &len);
  throw PeerFailure(cat("rank ", rank(), ": ", what, " failed: ", std::string(text, len)), {});
}

int MpiCommunicator::count(int64_t n) const {
  POLLEN_CHECK(
      n >= 0 && n <= std::numeric_limits<int>::max(), "collective of ", n,
      " elements: more than MPI's int count (2^31 - 1) allows; parallel.bucket_mb (at most "
      "4096) keeps buckets below it, so one parameter alone is that large (MPI cannot "
      "sum it in one piece)");
  return static_cast<int>(n);
}

void MpiCommunicator::announce() {
  ++seq_;
  for (int p = 0; p < world(); ++p) {
    if (p == rank()) continue;
    Notice n;
    n.seq = std::make_unique<int64_t>(seq_);
    MPI_Isend(n.seq.get(), 1, MPI_INT64_T, p, kArrivalTag, arrivals_, &n.request);
    sent_.push_back(std::move(n));
  }
}

void MpiCommunicator::poll_arrivals() {
  for (int p = 0; p < world(); ++p) {
    const auto i = static_cast<size_t>(p);
    while (arrival_recv_[i] != MPI_REQUEST_NULL) {
      int done = 0;
      check(MPI_Test(&arrival_recv_[i], &done, MPI_STATUS_IGNORE), "receiving a peer's progress");
      if (!done) break;
      last_arrival_[i] = arrival_buf_[i];
      MPI_Irecv(&arrival_buf_[i], 1, MPI_INT64_T, p, kArrivalTag, arrivals_, &arrival_recv_[i]);
    }
  }
  std::erase_if(sent_, [](Notice& n) {
    int done = 0;
    MPI_Test(&n.request, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
}

Request MpiCommunicator::track(MPI_Request request, std::string what) {
  const Request id = next_request_++;
  in_flight_[id] = InFlight{request, seq_, std::move(what)};
  return id;
}

Request MpiCommunicator::start_all_reduce(float* data, int64_t n, std::string what) {
  announce();
  MPI_Request r;
  check(MPI_Iallreduce(MPI_IN_PLACE, data, count(n), MPI_FLOAT, MPI_SUM, collectives_, &r), what);
  return track(r, std::move(what));
}

Request MpiCommunicator::start_reduce_scatter(const float* in, float* out, int64_t n,
                                              std::string what) {
  announce();
  MPI_Request r;
  check(MPI_Ireduce_scatter_block(in, out, count(n), MPI_FLOAT, MPI_SUM, collectives_, &r), what);
  return track(r, std::move(what));
}

Request MpiCommunicator::start_all_gather(const float* in, float* out, int64_t n,
                                          std::string what) {
  announce();
  MPI_Request r;
  check(MPI_Iallgather(in, count(n), MPI_FLOAT, out, count(n), MPI_FLOAT, collectives_, &r), what);
  return track(r, std::move(what));
}

Request MpiCommunicator::start_broadcast(float* data, int64_t n, int root, std::string what) {
  announce();
  MPI_Request r;
  check(MPI_Ibcast(data, count(n), MPI_FLOAT, root, collectives_, &r), what);
  return track(r, std::move(what));
}

void MpiCommunicator::progress() {
  for (auto& [id, f] : in_flight_) {
    int done = 0;
    check(MPI_Test(&f.request, &done, MPI_STATUS_IGNORE), f.what);
    if (done) f.request = MPI_REQUEST_NULL;  // MPI_Test freed it; wait() returns at once
  }
}

// A collective that a peer started and then hung after, in compute, cannot finish either: MPI
// moves it only inside that peer's MPI calls. So besides the peers behind the collective, the
// ones behind the latest collective this rank started (seq_) are named: a healthy peer catches
// up on that within a step, far less than the timeout.
PeerFailure MpiCommunicator::timed_out(const InFlight& f, double timeout_s) const {
  std::vector<int> never_reached, stopped_after, failed;
  for (int p = 0; p < world(); ++p) {
    const int64_t last = last_arrival_[static_cast<size_t>(p)];
    if (p == rank() || last >= seq_) continue;
    (last < f.seq ? never_reached : stopped_after).push_back(p);
    failed.push_back(p);
  }
  std::string who;
  if (!never_reached.empty())
    who = cat(ranks_text(never_reached), " never reached it (dead or hung)");
  if (!stopped_after.empty()) {
    who += cat(who.empty() ? "" : "; ", ranks_text(stopped_after),
               " reached it but not the collectives this rank started after it (dead or hung "
               "since, which leaves it unfinished)");
  }
  if (failed.empty()) who = "every rank reached it, so one hangs inside it";
  return PeerFailure(cat("rank ", rank(), ": ", f.what, " did not complete within ", timeout_s,
                         " s (parallel.timeout_s): ", who),
                     failed);
}

double MpiCommunicator::wait(Request request) {
  return wait_within(request, timeout_s_);
}

double MpiCommunicator::wait_within(Request request, double timeout_s) {
  const auto it = in_flight_.find(request);
  POLLEN_ASSERT(it != in_flight_.end());
  InFlight f = std::move(it->second);
  in_flight_.erase(it);
  const auto t0 = Clock::now();
  const bool watched = std::isfinite(timeout_s);
  const auto deadline = t0 + std::chrono::duration<double>(watched ? timeout_s : 0.0);
  for (int64_t polls = 0;; ++polls) {
    int done = 0;
    check(MPI_Test(&f.request, &done, MPI_STATUS_IGNORE), f.what);
    if (done) break;
    poll_arrivals();
    if (watched && Clock::now() > deadline) throw timed_out(f, timeout_s);
    pause_between_polls(polls);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void MpiCommunicator::all_reduce_sum(std::span<double> values, std::string what) {
  announce();
  MPI_Request r;
  check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), count(static_cast<int64_t>(values.size())),
                       MPI_DOUBLE, MPI_SUM, collectives_, &r),
        what);
  wait(track(r, std::move(what)));
}

Request MpiCommunicator::start_broadcast(std::span<int64_t> values, int root, std::string what) {
  announce();
  MPI_Request r;
  check(MPI_Ibcast(values.data(), count(static_cast<int64_t>(values.size())), MPI_INT64_T, root,
                   collectives_, &r),
        what);
  return track(r, std::move(what));
}

void MpiCommunicator::broadcast(std::span<int64_t> values, int root, std::string what) {
  wait(start_broadcast(values, root, std::move(what)));
}

void MpiCommunicator::wait_for_broadcast(std::span<int64_t> values, int root, std::string what) {
  wait_within(start_broadcast(values, root, std::move(what)),
              std::numeric_limits<double>::infinity());
}

void MpiCommunicator::abort_job(int exit_code) {
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; this keeps the compiler sure of it
}

}  // namespace pollen::dist
