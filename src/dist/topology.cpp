#include "dist/topology.h"

#include <charconv>
#include <cstdlib>
#include <cstring>

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

// Tasks on this node from Slurm's compressed list ("2(x3),1": the first node's count, which is
// this node's count on homogeneous allocations); 1 when unset or unreadable.
int slurm_tasks_per_node() {
  const char* v = std::getenv("SLURM_STEP_TASKS_PER_NODE");
  int out = 1;
  if (v && *v) std::from_chars(v, v + std::strlen(v), out);
  return out > 0 ? out : 1;
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

}  // namespace

Topology topology_from_environment() {
  Topology t;
  if (env_set("OMPI_COMM_WORLD_SIZE")) {
    t.launcher = "mpirun";
    t.world = env_int("OMPI_COMM_WORLD_SIZE", 1);
    t.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    t.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    t.local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (env_set("PMI_SIZE")) {
    t.launcher = "pmi";
    t.world = env_int("PMI_SIZE", 1);
    t.rank = env_int("PMI_RANK", 0);
    t.local_rank = env_int("MPI_LOCALRANKID", env_int("SLURM_LOCALID", 0));
    t.local_world = env_int("MPI_LOCALNRANKS", slurm_tasks_per_node());
  } else if (env_set("SLURM_STEP_NUM_TASKS")) {
    t.launcher = "slurm";
    t.world = env_int("SLURM_STEP_NUM_TASKS", 1);
    t.rank = env_int("SLURM_PROCID", 0);
    t.local_rank = env_int("SLURM_LOCALID", 0);
    t.local_world = slurm_tasks_per_node();
  }
  POLLEN_CHECK(t.world >= 1 && t.rank < t.world, "launcher environment (", t.launcher, "): rank ",
               t.rank, " is not in [0, ", t.world, ")");
  POLLEN_CHECK(t.local_world >= 1 && t.local_rank < t.local_world, "launcher environment (",
               t.launcher, "): local rank ", t.local_rank, " is not in [0, ", t.local_world, ")");
  return t;
}

}  // namespace pollen::dist
