// pollen fed post: federated post-training with LoRA adapters as the exchanged state, simulated in
// one process by the server's and the clients' own code (fed/post_lora.h, fed/run.h).
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "fed/post_lora.h"
#include "fed/run.h"

namespace pollen::cli {

namespace {

// With the final adapters, on each silo's held-out data: the loss, and the objective's headline
// metric when it has one (GRPO's reward, whose negation is its held-out loss). A run stopped by a
// signal has no final evaluation.
void print_held_out(const fed::SimulationResult& r) {
  if (r.clients.empty()) return;
  if (r.headline.empty()) {
    std::printf("%-24s %s\n", "silo", "held-out loss");
    for (size_t i = 0; i < r.clients.size(); ++i)
      std::printf("%-24s %.4f\n", r.clients[i].c_str(), r.eval_loss[i]);
    return;
  }
  std::printf("%-24s %-14s held-out %s\n", "silo", "held-out loss", r.headline.c_str());
  for (size_t i = 0; i < r.clients.size(); ++i)
    std::printf("%-24s %-14.4f %.4f\n", r.clients[i].c_str(), r.eval_loss[i], r.eval_headline[i]);
}

}  // namespace

void add_fed_post_command(CLI::App& app) {
  CLI::App* fed = app.get_subcommand("fed");
  auto config = std::make_shared<std::string>();
  auto resume = std::make_shared<bool>(false);
  auto* post = fed->add_subcommand(
      "post",
      "Federated post-training (SFT, DPO, GRPO or a reward model) with LoRA adapters, simulated: "
      "the server and one client per silo in one process, the silos training from the round's "
      "adapters and sending only B (A shared and frozen; a reward model's score head beside it), "
      "see docs/federated.md");
  post->add_option("--config", *config, "fed-sft-lora.toml")->required();
  post->add_flag("--resume", *resume,
                 "continue from the newest checkpoint in federation.output (the server's and the "
                 "silos' states)");
  post->callback([config, resume] {
    const fed::SimConfig cfg = fed::load_fed_post_config(*config);
    const fed::SimulationResult r = fed::run_simulation(cfg, *resume);
    print_held_out(r);
    std::printf("%lld rounds; adapter/ (PEFT), %smetrics.jsonl and tensorboard/ in %s\n",
                static_cast<long long>(r.rounds),
                cfg.server.post.objective == "rm" ? "reward_model/, " : "", cfg.server.dir.c_str());
    // As `fed simulate`: a run that stopped early fails.
    if (r.rounds < cfg.server.rounds)
      throw Error(cat("stopped after ", r.rounds, " of ", cfg.server.rounds, " rounds",
                      r.stopped.empty() ? "" : ": " + r.stopped));
  });
}

}  // namespace pollen::cli
