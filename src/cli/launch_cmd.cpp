// `pollen launch --nproc N -- train --config run.toml ...`: wiring only; the command line is
// dist::launch_command's.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "dist/launch.h"

namespace pollen::cli {

void add_launch_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Run a pollen command as N data-parallel ranks on this node, through OpenMPI's mpirun "
      "(docs/parallel.md). Several nodes: mpirun with a hostfile, or srun under Slurm.\n"
      "Example: pollen launch --nproc 4 -- train --config run.toml\n"
      "Exit status: the job's (pollen train: 4 when a rank died or hung).");
  auto opts = std::make_shared<dist::LaunchOptions>();
  auto rest = std::make_shared<std::vector<std::string>>();
  cmd->add_option("--nproc", opts->nproc, "Ranks to start")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--mpirun", opts->mpirun, "The mpirun to use")->capture_default_str();
  cmd->add_option("--mpirun-arg", opts->mpirun_args,
                  "An extra argument for mpirun, before the program (repeatable)");
  cmd->add_option("command", *rest, "The pollen command and its arguments, after --")->required();
  // This binary's own path: each rank runs the same pollen.
  cmd->callback([opts, rest] {
    dist::exec_launch(*opts, std::filesystem::read_symlink("/proc/self/exe").string(), *rest);
  });
}

}  // namespace pollen::cli
