#pragma once
// `pollen launch --nproc N -- <command> ...`: N ranks of pollen on this node, started by
// OpenMPI's mpirun (the engine clusters already run; no launcher of our own). The ranks read
// their place from mpirun's environment (topology.h).
#include <string>
#include <vector>

#include "dist/topology.h"

namespace pollen::dist {

struct LaunchOptions {
  int nproc = 1;
  std::string mpirun = "mpirun";
  std::vector<std::string> mpirun_args;  // passed to mpirun before the program (--mca ...)
};

// The command line that runs `program args...` as nproc ranks on this node: mpirun -np N
// --bind-to none (each rank runs a pool of threads) --oversubscribe (ranks may outnumber cores)
// [--allow-run-as-root when run as root].
std::vector<std::string> launch_command(const LaunchOptions& options, const std::string& program,
                                        const std::vector<std::string>& args);

// Whether the pollen command whose words are `command` ({"train", ...}, {"fed", "client", ...};
// its options may follow) runs as several ranks: pollen train, sft, dpo, rm, grpo and fed client
// train as one data-parallel job, and pollen version reports on every rank; every other command
// (fed post, and subcommands such as rm score or grpo synth, among them) runs as one process.
bool runs_as_ranks(const std::vector<std::string>& command);

// A command that runs as one process, started as several ranks, would run once per rank into
// the same outputs: refused, naming the command, the ranks and their launcher.
void refuse_ranks_unless_supported(const std::vector<std::string>& command,
                                   const Topology& topology);

// Replaces this process with that command (its exit status is the job's); throws if mpirun
// cannot be started, or when nproc > 1 for a command that runs as one process.
[[noreturn]] void exec_launch(const LaunchOptions& options, const std::string& program,
                              const std::vector<std::string>& args);

}  // namespace pollen::dist
