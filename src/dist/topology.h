#pragma once
// Where this process stands in a data-parallel job: its rank, the world size and its place on
// its node, read from the launcher's environment (mpirun, srun, or pollen launch, which runs
// mpirun). No launcher, or a world of one: a single process that needs no MPI at all.
#include <string>

namespace pollen::dist {

struct Topology {
  int rank = 0, world = 1;              // in the whole job
  int local_rank = 0, local_world = 1;  // on this node
  std::string launcher = "none";        // "mpirun", "pmi", "slurm" or "none"
  bool srun_without_pmix = false;       // ranks of srun that MPI cannot join (check_joinable)
  bool distributed() const { return world > 1; }
};

// Reads OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (mpirun), else PMI_RANK/PMI_SIZE
// (MPICH-style and PMIx launchers), else SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID
// (srun; an sbatch script outside srun is not a job step and counts as one process).
// A malformed variable is an error naming it.
Topology topology_from_environment();

// Throws, saying what to change, when MPI could not join the ranks: srun's tasks without PMIx
// (OpenMPI joins them only through it). Checked when the ranks connect, after a command that runs
// as one process has been refused for what it is.
void check_joinable(const Topology& topology);

}  // namespace pollen::dist
