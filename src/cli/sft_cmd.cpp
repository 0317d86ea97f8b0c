// `pollen sft --config run.toml [--set key=value ...] [--resume]` and `pollen sft synth`:
// wiring only; the loop is train::run_post_training, the objective train::SftObjective.
#include <string>

#include "cli/commands.h"
#include "cli/post_command.h"
#include "train/sft.h"

namespace pollen::cli {

void add_sft_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "sft", std::string("Supervised fine-tuning on conversations as one TOML run file describes "
                         "(docs/posttraining.md).") +
                 kPostExitCodes + kPostDataParallel);
  add_post_run_options(cmd, "sft", "sft.seq=512",
                       [](const train::PostConfig& cfg, const train::PostOptions& o) {
                         return train::run_post_training(cfg, o, train::make_sft_objective);
                       });
  add_task_synth(cmd,
                 "Write example SFT conversations made from templates (JSONL, one {\"messages\": "
                 "[...]} per line; every reply ends with \"#### ANSWER\")",
                 "conversations", train::sft_jsonl_line);
}

}  // namespace pollen::cli
