#pragma once
// How `pollen train` and the post-training commands end, alone or as one rank of a job.
#include <functional>

#include "dist/communicator.h"
#include "train/run_control.h"

namespace pollen::cli {

// Runs a training loop as this process's part of `comm`'s job and ends as the loop did: an error
// on one rank of several ends the whole job (the other ranks would wait for it in a collective);
// the run's message is logged at the level its status calls for, a rank that died or hung ends
// the job (the hung one too), and the status becomes the exit code.
void run_as_job(dist::Communicator& comm, const std::function<train::RunResult()>& run);

}  // namespace pollen::cli
