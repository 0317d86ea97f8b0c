// `pollen grpo synth`: wiring only; the data is train::write_arithmetic_prompts.
#include <memory>
#include <string>

#include "base/log.h"
#include "cli/commands.h"
#include "train/grpo.h"

namespace pollen::cli {

void add_grpo_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "grpo", "RL with verifiable rewards (GRPO): sampled completions scored by a verifier");
  cmd->require_subcommand(1);

  auto* synth = cmd->add_subcommand(
      "synth", "Write example prompts JSONL ({\"prompt\", \"answer\"}) for `pollen grpo`");
  auto task = std::make_shared<std::string>("arithmetic");
  auto count = std::make_shared<int64_t>(1000);
  auto seed = std::make_shared<uint64_t>(0);
  auto out = std::make_shared<std::string>();
  synth->add_option("--task", *task, "What to write: arithmetic (\"What is 17 + 25?\", answer 42)")
      ->check(CLI::IsMember({"arithmetic"}))
      ->capture_default_str();
  synth->add_option("--count", *count, "How many prompts")->capture_default_str();
  synth->add_option("--seed", *seed, "Seed of the generator")->capture_default_str();
  synth->add_option("--out", *out, "JSONL file to write")->required();
  synth->callback([count, seed, out] {
    train::write_arithmetic_prompts(*out, *count, *seed);
    log::info("wrote ", *count, " arithmetic prompts to ", *out);
  });
}

}  // namespace pollen::cli
