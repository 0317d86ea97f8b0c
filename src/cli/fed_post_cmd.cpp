// pollen fed post: federated post-training with LoRA adapters as the exchanged state, simulated in
// one process by the server's and the clients' own code (fed/post_lora.h, fed/run.h).
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "fed/held_out_table.h"
#include "fed/post_lora.h"
#include "fed/run.h"

namespace pollen::cli {

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
    std::fputs(fed::held_out_table(r, "held-out loss").c_str(), stdout);
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
