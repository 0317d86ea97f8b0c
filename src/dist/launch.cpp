#include "dist/launch.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace pollen::dist {

std::vector<std::string> launch_command(const LaunchOptions& o, const std::string& program,
                                        const std::vector<std::string>& args) {
  POLLEN_CHECK(o.nproc >= 1, "launch: --nproc must be 1 or more, got ", o.nproc);
  std::vector<std::string> cmd{o.mpirun,    "-np",  std::to_string(o.nproc),
                               "--bind-to", "none", "--oversubscribe"};
  if (::geteuid() == 0) cmd.push_back("--allow-run-as-root");
  cmd.insert(cmd.end(), o.mpirun_args.begin(), o.mpirun_args.end());
  cmd.push_back(program);
  cmd.insert(cmd.end(), args.begin(), args.end());
  return cmd;
}

bool runs_as_ranks(const std::vector<std::string>& command) {
  if (command.empty()) return false;
  // The command itself, not one of its subcommands (rm score, sft synth): its options follow.
  auto bare_after = [&](size_t words) {
    return command.size() == words || command[words].starts_with("-");
  };
  const std::string& first = command[0];
  if (first == "train" || first == "sft" || first == "dpo" || first == "rm" || first == "grpo")
    return bare_after(1);
  if (first == "fed") return command.size() > 1 && command[1] == "client" && bare_after(2);
  return first == "version";
}

namespace {

// A word of a command's name (train, fed, client, score), not an option or an argument (a path).
bool command_word(const std::string& w) {
  return !w.empty() && !w.starts_with("-") && std::all_of(w.begin(), w.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  });
}

// The subcommands of the commands that run as ranks, each of which runs as one process.
bool is_one_process_subcommand(const std::string& command, const std::string& word) {
  return word == "synth" || (command == "rm" && word == "score");
}

}  // namespace

void refuse_ranks_unless_supported(const std::vector<std::string>& command,
                                   const Topology& topology) {
  if (topology.world <= 1 || runs_as_ranks(command)) return;
  std::string name;
  size_t words = 0;
  for (; words < command.size() && command_word(command[words]); ++words)
    name += (name.empty() ? "" : " ") + command[words];
  // `pollen launch --nproc 2 -- train run.toml`: a rank command given an argument it takes as
  // an option's value, not a command that runs as one process.
  const size_t named = command.size() > 1 && command[0] == "fed" && command[1] == "client" ? 2 : 1;
  if (command.size() > named && !command[named].starts_with("-") &&
      !is_one_process_subcommand(command[0], command[named]) &&
      runs_as_ranks({command.begin(), command.begin() + static_cast<std::ptrdiff_t>(named)})) {
    const std::string rank_command = named == 2 ? "fed client" : command[0];
    fail("pollen ", rank_command, ": '", command[named], "' is not one of its options (the run ",
         "file goes after --config: pollen ", rank_command, " --config ", command[named], ")");
  }
  // `pollen launch --nproc 2 -- --help`: options alone, no command to name.
  if (name.empty() && !command.empty()) name = command.front();
  fail("pollen ", name.empty() ? "without a command" : name, " runs as one process, but ",
       topology.launcher, " started ", topology.world,
       " ranks of it, which would each run it into the same outputs; only ",
       "pollen train, sft, dpo, rm, grpo and fed client run as several ranks (docs/parallel.md). ",
       "Run it without mpirun, srun or pollen launch");
}

void exec_launch(const LaunchOptions& o, const std::string& program,
                 const std::vector<std::string>& args) {
  Topology ranks;
  ranks.world = o.nproc;
  ranks.launcher = "pollen launch";
  refuse_ranks_unless_supported(args, ranks);
  const auto cmd = launch_command(o, program, args);
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  fail("launch: cannot run '", o.mpirun, "': ", std::strerror(errno),
       " (install OpenMPI: apt-get install openmpi-bin)");
}

}  // namespace pollen::dist
