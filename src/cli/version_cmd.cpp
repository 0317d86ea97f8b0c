// `pollen version`: what this binary is, what it was built from, and what it can use.
#include <cblas.h>

#include <cstdio>

#include "base/thread_pool.h"
#include "cli/commands.h"
#include "pollen/build_info.h"
#include "tensor/device.h"

namespace pollen::cli {

void add_version_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("version", "Print the version, the git commit, and the backends");
  cmd->callback([] {
    std::printf("pollen %s (commit %s, %s build, %s)\n", build::kVersion, build::kGitCommit,
                build::kBuildType, build::kCompiler);
    std::printf("cpu: %d threads, BLAS: %s\n", num_threads(), openblas_get_config());
    std::printf("cuda: %s\n", cuda_status().c_str());
    for (const auto& g : cuda_devices()) {
      std::printf("  gpu %d: %s, %.1f GiB, compute capability %d.%d\n", g.index, g.name.c_str(),
                  static_cast<double>(g.memory_bytes) / (1 << 30), g.compute_major,
                  g.compute_minor);
    }
  });
}

}  // namespace pollen::cli
