#include "cli/run_job.h"

#include <exception>
#include <string>

#include "base/log.h"
#include "cli/commands.h"

namespace pollen::cli {

void run_as_job(dist::Communicator& comm, const std::function<train::RunResult()>& run) {
  train::RunResult r;
  try {
    r = run();
  } catch (const std::exception& e) {
    if (comm.world() == 1) throw;
    // Named by rank, once: many messages of a rank's own trouble name it already.
    const std::string what = e.what();
    log::error(what.starts_with(cat("rank ", comm.rank(), " ")) ||
                       what.starts_with(cat("rank ", comm.rank(), ":"))
                   ? what
                   : cat("rank ", comm.rank(), ": ", what));
    comm.abort_job(static_cast<int>(train::RunStatus::failed));
  }
  switch (r.status) {
    case train::RunStatus::finished:
      log::info(r.message);
      break;
    case train::RunStatus::preempted:  // every rank stopped at the same step
      log::warn_job(r.message);
      break;
    case train::RunStatus::failed:
      log::error(r.message);
      break;
    case train::RunStatus::rank_failed:
      log::error(r.message);
      comm.abort_job(static_cast<int>(r.status));
  }
  set_exit_code(static_cast<int>(r.status));
}

}  // namespace pollen::cli
