// `pollen grpo --config run.toml [--set key=value ...] [--resume]` and `pollen grpo synth`:
// wiring only; the loop is train::run_post_training, the objective train::GrpoObjective.
#include <string>

#include "cli/commands.h"
#include "cli/post_command.h"
#include "train/grpo.h"

namespace pollen::cli {

void add_grpo_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "grpo",
      std::string("RL with verifiable rewards (GRPO): sampled completions scored by a verifier, "
                  "as one TOML run file describes (docs/grpo.md).") +
          kPostExitCodes + kPostDataParallel);
  add_post_run_options(cmd, "grpo", "grpo.group_size=16",
                       [](const train::PostConfig& cfg, const train::PostOptions& o) {
                         return train::run_post_training(
                             cfg, o, [](const train::ObjectiveContext& context) {
                               return train::make_grpo_objective(context, context.base);
                             });
                       });
  add_task_synth(cmd,
                 "Write example GRPO prompts made from templates (JSONL, one {\"messages\": [...], "
                 "\"answer\": ...} per line; the answers SFT data of the same task teaches as "
                 "\"#### ANSWER\")",
                 "prompts", train::grpo_jsonl_line);
}

}  // namespace pollen::cli
