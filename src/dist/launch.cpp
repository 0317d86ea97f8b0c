#include "dist/launch.h"

#include <unistd.h>

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

void exec_launch(const LaunchOptions& o, const std::string& program,
                 const std::vector<std::string>& args) {
  const auto cmd = launch_command(o, program, args);
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  fail("launch: cannot run '", o.mpirun, "': ", std::strerror(errno),
       " (install OpenMPI: apt-get install openmpi-bin)");
}

}  // namespace pollen::dist
