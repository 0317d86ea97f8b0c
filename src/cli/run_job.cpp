#include "cli/run_job.h"

#include <exception>

#include "base/log.h"
#include "cli/commands.h"

namespace pollen::cli {

void run_as_job(dist::Communicator& comm, const std::function<train::RunResult()>& run) {
  train::RunResult r;
  try {
    r = run();
  } catch (const std::exception& e) {
    if (comm.world() == 1) throw;
    log::error("rank ", comm.rank(), ": ", e.what());
    comm.abort_job(static_cast<int>(train::RunStatus::failed));
  }
  switch (r.status) {
    case train::RunStatus::finished:
      log::info(r.message);
      break;
    case train::RunStatus::preempted:
      log::warn(r.message);
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
