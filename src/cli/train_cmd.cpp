// `pollen train --config run.toml [--set key=value ...] [--resume]`: wiring only; the trainer is
// train::run_training.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "base/log.h"
#include "cli/commands.h"
#include "cli/run_job.h"
#include "dist/communicator.h"
#include "dist/same_inputs.h"
#include "train/config.h"
#include "train/trainer.h"

namespace pollen::cli {

void add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train",
      "Pre-train a model as one TOML run file describes (docs/training.md).\n"
      "Exit codes: 0 finished, 1 failed (bad config or data, too many non-finite losses in a "
      "row, any error), 3 preempted (SIGINT or SIGTERM: the step finished and a checkpoint "
      "was written; rerun with --resume), 4 a rank of a data-parallel job died or hung "
      "(rerun with --resume), 2 bad command line.\n"
      "Data parallel: run it under mpirun -np N, srun, or pollen launch --nproc N "
      "(docs/parallel.md).\n"
      "Record-level differential privacy (DP-SGD): a [privacy] table in the run file "
      "(docs/training.md).");
  auto config = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto resume = std::make_shared<bool>(false);
  cmd->add_option("--config", *config, "Run file (TOML)")->required();
  cmd->add_option("--set", *sets,
                  "Override a key, e.g. --set train.steps=200 --set optimizer.lr=1e-3 (value in "
                  "TOML syntax; a bare word is a string)")
      ->check(key_equals_value());
  cmd->add_flag("--resume", *resume,
                "Continue from the newest checkpoint under run.dir/checkpoints that verifies "
                "(starts at step 0 when there is none yet)");
  auto device = std::make_shared<std::string>();
  cmd->add_option("--device", *device,
                  "cpu or cuda: where the model, its gradients and AdamW's state live (as "
                  "--set run.device=...; on cuda, run.precision = \"bf16\" computes in bf16 "
                  "with f32 master weights)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([config, sets, resume, device] {
    if (!device->empty()) sets->push_back("run.device=" + *device);
    const train::TrainConfig cfg = train::load_train_config(*config, *sets);
    train::check_manifests_exist(cfg, *config);
    // One process unless a launcher (mpirun, srun) started several.
    train::TrainOptions o;
    o.fault = train::fault_from_environment();
    const auto comm = train::connect_ranks(cfg.timeout_s, o.fault);
    if (comm->rank() != 0) log::follow_job_lead();  // rank 0 reports for the job
    o.resume = *resume;
    o.comm = comm.get();
    std::vector<std::filesystem::path> data(cfg.manifests.begin(), cfg.manifests.end());
    data.insert(data.end(), cfg.validation_manifests.begin(), cfg.validation_manifests.end());
    run_as_job(*comm, [&] {
      dist::check_ranks_run_the_same(*comm, {*config, rank_options(*sets, *resume), data});
      return train::run_training(cfg, o);
    });
  });
}

}  // namespace pollen::cli
