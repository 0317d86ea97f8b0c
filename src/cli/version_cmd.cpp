// `pollen version`: what this binary is, what it was built from, and what it can use.
#include <cblas.h>

#include <cstdio>

#include "base/error.h"
#include "base/thread_pool.h"
#include "cli/commands.h"
#include "pollen/build_info.h"
#if POLLEN_HAVE_CUDA
#include "ops/cuda/cublaslt.h"
#endif
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
#if POLLEN_HAVE_CUDA
    // Loaded at the first GEMM on a GPU; where there is one, say which library GEMMs will use.
    if (!cuda_devices().empty()) {
      try {
        std::printf("  gemm: %s\n", ops::cuda::cublaslt_description().c_str());
      } catch (const Error& e) {
        std::printf("  gemm: unavailable: %s\n", e.what());
      }
    }
#endif
  });
}

}  // namespace pollen::cli
