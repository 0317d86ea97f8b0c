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
      "Run pollen train, sft, dpo, rm, grpo or fed client as N data-parallel ranks on this node, "
      "through OpenMPI's mpirun (docs/parallel.md); other commands refuse to run as ranks. Several "
      "nodes: mpirun with a hostfile, or srun under Slurm.\n"
      "Example: pollen launch --nproc 4 -- train --config run.toml\n"
      "Exit status: mpirun's. For pollen train, sft, dpo, rm, grpo and fed client: 4 when the "
      "watchdog saw a rank die or hang, 3 when the ranks stopped on SIGINT or SIGTERM sent to "
      "them; a rank killed outright is often seen first by mpirun, which then exits with its own "
      "status (137 for SIGKILL); a signal sent to mpirun reaches the ranks, but mpirun ends them "
      "after a short grace period and exits with 1 (send it to the ranks: docs/parallel.md).");
  auto opts = std::make_shared<dist::LaunchOptions>();
  cmd->add_option("--nproc", opts->nproc, "Ranks to start")->required()->check(one_or_more());
  cmd->add_option("--mpirun", opts->mpirun, "The mpirun to use")->capture_default_str();
  cmd->add_option("--mpirun-arg", opts->mpirun_args,
                  "An extra argument for mpirun, before the program (repeatable: one argument "
                  "each, e.g. --mpirun-arg=-x --mpirun-arg=OMP_NUM_THREADS)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  // The command's first word, then everything after it (launch's own options come first; an
  // optional -- ends them), passed on untouched. The first word is a positional so that CLI11
  // lets a subcommand see the arguments after --; the rest are remaining() by prefix_command.
  auto first = std::make_shared<std::string>();
  cmd->add_option("command", *first, "The pollen command to run, then its arguments");
  cmd->prefix_command();
  cmd->callback([&app, cmd, opts, first] {
    std::vector<std::string> rest = cmd->remaining();
    if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());  // launch's own --
    if (!first->empty()) rest.insert(rest.begin(), *first);
    if (rest.empty()) throw CLI::RequiredError("launch: the pollen command to run, after --");
    const auto named = [&](const CLI::App* sub) { return sub->check_name(rest.front()); };
    if (!rest.front().starts_with("-") && app.get_subcommands(named).empty())
      throw CLI::ValidationError("launch", "'" + rest.front() +
                                               "' is not a pollen command (pollen --help lists "
                                               "them)");
    // This binary's own path: each rank runs the same pollen.
    dist::exec_launch(*opts, std::filesystem::read_symlink("/proc/self/exe").string(), rest);
  });
}

void refuse_ranks_unless_supported(const CLI::App& app) {
  std::vector<std::string> words;
  for (const CLI::App* at = &app; !at->get_subcommands().empty();) {
    at = at->get_subcommands().front();
    words.push_back(at->get_name());
  }
  dist::refuse_ranks_unless_supported(words, dist::topology_from_environment());
}

}  // namespace pollen::cli
