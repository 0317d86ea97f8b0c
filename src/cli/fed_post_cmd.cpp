// pollen fed post: federated post-training with LoRA adapters as the exchanged state, simulated in
// one process (fed/post_lora.h).
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "fed/post_lora.h"

namespace pollen::cli {

void add_fed_post_command(CLI::App& app) {
  CLI::App* fed = app.get_subcommand("fed");
  auto config = std::make_shared<std::string>();
  auto* post = fed->add_subcommand(
      "post",
      "Federated post-training (SFT, DPO, GRPO or a reward model) with LoRA adapters, simulated: "
      "silos in one process train from the round's adapters and send only B (A shared and "
      "frozen; a reward model's score head beside it), see docs/federated.md");
  post->add_option("--config", *config, "fed-sft-lora.toml")->required();
  post->callback([config] {
    const fed::LoraFedConfig cfg = fed::load_lora_fed_config(*config);
    const std::string base = train::load_post_config(cfg.run_file, cfg.objective).base;
    const fed::LoraFedResult r = fed::run_lora_federation(
        cfg, fed::lora_objective_factory(cfg.objective, *config + ": federation.objective", base));
    // With the final adapters, on each silo's held-out data: the loss, and the objective's
    // headline metric when it has one (GRPO's reward, whose negation is its held-out loss).
    if (r.headline.empty()) {
      std::printf("%-24s %s\n", "silo", "held-out loss");
      for (size_t i = 0; i < cfg.silos.size(); ++i)
        std::printf("%-24s %.4f\n", cfg.silos[i].c_str(), r.eval_loss[i]);
    } else {
      std::printf("%-24s %-14s held-out %s\n", "silo", "held-out loss", r.headline.c_str());
      for (size_t i = 0; i < cfg.silos.size(); ++i)
        std::printf("%-24s %-14.4f %.4f\n", cfg.silos[i].c_str(), r.eval_loss[i],
                    r.eval_headline[i]);
    }
    std::printf("%zu rounds; adapters (PEFT), %smetrics.jsonl and tensorboard/ in %s\n",
                r.rounds.size(), cfg.objective == "rm" ? "reward_model/, " : "",
                cfg.output.c_str());
  });
}

}  // namespace pollen::cli
