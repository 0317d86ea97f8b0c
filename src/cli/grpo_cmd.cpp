// `pollen grpo --config run.toml [--set key=value ...] [--resume]` and `pollen grpo synth`:
// wiring only; the loop is train::run_post_training, the objective train::GrpoObjective.
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/log.h"
#include "cli/commands.h"
#include "train/grpo.h"
#include "train/post_config.h"
#include "train/post_run.h"
#include "train/synth_tasks.h"

namespace pollen::cli {
namespace {

void add_grpo_synth(CLI::App* grpo) {
  auto* cmd = grpo->add_subcommand(
      "synth",
      "Write example GRPO prompts made from templates (JSONL, one {\"messages\": [...], "
      "\"answer\": ...} per line; the answers SFT data of the same task teaches as \"#### "
      "ANSWER\")");
  struct Args {
    std::string task, out;
    int64_t count = 1000;
    uint64_t seed = 0;
    int digits = 2;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--task", a->task, "arithmetic, reverse or upper")
      ->required()
      ->check(CLI::IsMember(train::synth_task_names()));
  cmd->add_option("--count", a->count, "Prompts to write")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed (the same seed writes the same file)")
      ->capture_default_str();
  cmd->add_option("--digits", a->digits, "arithmetic: operands of at most this many digits")
      ->check(CLI::Range(1, 9))
      ->capture_default_str();
  cmd->add_option("--out", a->out, "JSONL file to write")->required();
  cmd->callback([a] {
    const auto examples = train::synth_examples(a->task, a->count, a->seed, a->digits);
    const std::filesystem::path parent = std::filesystem::path(a->out).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream out(a->out, std::ios::binary);
    POLLEN_CHECK(out.good(), "cannot write '", a->out, "'");
    for (const auto& e : examples) out << train::grpo_jsonl_line(e) << "\n";
    out.close();
    POLLEN_CHECK(out.good(), "cannot write '", a->out, "'");
    log::info("wrote ", examples.size(), " ", a->task, " prompts to '", a->out, "'");
  });
}

}  // namespace

void add_grpo_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "grpo",
      "RL with verifiable rewards (GRPO): sampled completions scored by a verifier, as one TOML "
      "run file describes (docs/grpo.md).\n"
      "Exit codes: 0 finished, 1 failed (bad config or data, too many non-finite losses in a "
      "row, any error), 3 preempted (SIGINT or SIGTERM: the step finished and a checkpoint "
      "was written; rerun with --resume), 2 bad command line.");
  cmd->require_subcommand(0, 1);
  auto config = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto resume = std::make_shared<bool>(false);
  cmd->add_option("--config", *config, "Run file (TOML)");
  cmd->add_option("--set", *sets,
                  "Override a key, e.g. --set train.steps=200 --set grpo.group_size=16 (value in "
                  "TOML syntax; a bare word is a string)");
  cmd->add_flag("--resume", *resume,
                "Continue from the newest checkpoint under run.dir/checkpoints that verifies "
                "(starts at step 0 when there is none yet)");
  add_grpo_synth(cmd);
  cmd->callback([cmd, config, sets, resume] {
    if (!cmd->get_subcommands().empty()) return;  // `pollen grpo synth` ran
    if (config->empty()) throw CLI::RequiredError("--config");
    const train::PostConfig cfg = train::load_post_config(*config, "grpo", *sets);
    train::PostOptions o;
    o.resume = *resume;
    const train::PostResult r =
        train::run_post_training(cfg, o, [&cfg](const train::ObjectiveContext& context) {
          return train::make_grpo_objective(context, cfg.base);
        });
    if (r.status == train::RunStatus::finished) {
      log::info(r.message);
    } else if (r.status == train::RunStatus::preempted) {
      log::warn(r.message);
    } else {
      log::error(r.message);
    }
    set_exit_code(static_cast<int>(r.status));
  });
}

}  // namespace pollen::cli
