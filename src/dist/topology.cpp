#include "dist/topology.h"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/error.h"

namespace pollen::dist {
namespace {

// The integer in environment variable `name`, or `fallback` when it is not set.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  int out = 0;
  const char* end = v + std::strlen(v);
  const auto [ptr, ec] = std::from_chars(v, end, out);
  POLLEN_CHECK(ec == std::errc() && ptr == end && out >= 0, "environment variable ", name, "='", v,
               "': expected a non-negative integer");
  return out;
}

// Tasks on this node (SLURM_NODEID-th of the step's nodes) from Slurm's compressed list of
// tasks per node, "2(x3),1": three nodes with 2 tasks, then one with 1.
int slurm_tasks_per_node() {
  const char* v = std::getenv("SLURM_STEP_TASKS_PER_NODE");
  const std::string list = v ? v : "";
  const int node = env_int("SLURM_NODEID", 0);
  int first_node = 0;  // of the entry being read
  size_t at = 0;
  while (at < list.size()) {
    int tasks = 0, repeat = 1;
    const char* p = list.data() + at;
    const char* end = list.data() + list.size();
    auto r = std::from_chars(p, end, tasks);
    if (r.ec == std::errc() && r.ptr + 2 < end && r.ptr[0] == '(' && r.ptr[1] == 'x') {
      r = std::from_chars(r.ptr + 2, end, repeat);
      if (r.ec == std::errc() && r.ptr < end && *r.ptr == ')')
        ++r.ptr;
      else
        r.ec = std::errc::invalid_argument;
    }
    POLLEN_CHECK(r.ec == std::errc() && (r.ptr == end || *r.ptr == ',') && tasks > 0 && repeat > 0,
                 "environment variable SLURM_STEP_TASKS_PER_NODE='", list,
                 "': expected tasks per node as Slurm writes them, such as 2(x3),1");
    if (node < first_node + repeat) return tasks;
    first_node += repeat;
    at = static_cast<size_t>(r.ptr - list.data()) + 1;
  }
  POLLEN_CHECK(list.empty(), "environment variable SLURM_STEP_TASKS_PER_NODE='", list,
               "' lists fewer nodes than SLURM_NODEID=", node, " needs");
  return 1;
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

// The integer in `name`, which the launcher that set `by` always sets too.
int env_required(const char* name, const char* by) {
  POLLEN_CHECK(env_set(name), "launcher environment: ", by, " is set but ", name,
               " is not (a launcher sets both; was the environment copied from another job?)");
  return env_int(name, 0);
}

}  // namespace

Topology topology_from_environment() {
  Topology t;
  if (env_set("OMPI_COMM_WORLD_SIZE")) {
    t.launcher = "mpirun";
    t.world = env_int("OMPI_COMM_WORLD_SIZE", 1);
    t.rank = env_required("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    t.local_rank = env_required("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE");
    t.local_world = env_required("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE");
  } else if (env_set("PMI_SIZE")) {
    t.launcher = "pmi";
    t.world = env_int("PMI_SIZE", 1);
    t.rank = env_required("PMI_RANK", "PMI_SIZE");
    t.local_rank = env_int("MPI_LOCALRANKID", env_int("SLURM_LOCALID", 0));
    t.local_world = env_int("MPI_LOCALNRANKS", slurm_tasks_per_node());
  } else if (env_set("SLURM_STEP_NUM_TASKS")) {
    t.launcher = "slurm";
    t.world = env_int("SLURM_STEP_NUM_TASKS", 1);
    t.rank = env_required("SLURM_PROCID", "SLURM_STEP_NUM_TASKS");
    t.local_rank = env_required("SLURM_LOCALID", "SLURM_STEP_NUM_TASKS");
    t.local_world = slurm_tasks_per_node();
  }
  // OpenMPI (Debian's 4.1, and every 5.x) joins srun's tasks into one job only through PMIx;
  // under PMI-2 or none MPI_Init fails with advice to rebuild OpenMPI: say what to change.
  const bool srun = env_set("SLURM_STEP_NUM_TASKS") && t.launcher != "mpirun";
  t.srun_without_pmix = srun && t.world > 1 && !env_set("PMIX_RANK");
  POLLEN_CHECK(t.world >= 1 && t.rank < t.world, "launcher environment (", t.launcher, "): rank ",
               t.rank, " is not in [0, ", t.world, ")");
  POLLEN_CHECK(t.local_world >= 1 && t.local_rank < t.local_world, "launcher environment (",
               t.launcher, "): local rank ", t.local_rank, " is not in [0, ", t.local_world, ")");
  POLLEN_CHECK(t.local_world <= t.world, "launcher environment (", t.launcher, "): ", t.local_world,
               " ranks on this node, more than the job's ", t.world);
  return t;
}

void check_joinable(const Topology& t) {
  POLLEN_CHECK(!t.srun_without_pmix, "srun started rank ", t.rank, " of ", t.world,
               " without PMIx (PMIX_RANK is not set), so MPI cannot join the ranks: launch with "
               "srun --mpi=pmix (not pmi2 or none), or set MpiDefault=pmix in slurm.conf "
               "(docs/parallel.md)");
}

}  // namespace pollen::dist
