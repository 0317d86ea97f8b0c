// `pollen eval`: wiring only; the scoring is eval::perplexity.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/thread_pool.h"
#include "cli/commands.h"
#include "eval/perplexity.h"
#include "model/config.h"
#include "model/llama.h"

namespace pollen::cli {

void add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "eval",
      "Validation loss and perplexity of a checkpoint over token-shard manifests, every token "
      "scored once; one JSON line per manifest");
  struct Args {
    std::string model, checkpoint, split = "validation";
    std::vector<std::string> data;
    int64_t seq = 128, batch = 8;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "Model preset or pollen model file (TOML)")->required();
  cmd->add_option("--checkpoint", a->checkpoint,
                  "Checkpoint folder (of pollen train or pollen fed) or a .safetensors file")
      ->required()
      ->check(CLI::ExistingPath);
  cmd->add_option("--data", a->data, "manifest.json files of pollen data prepare")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--split", a->split, "Split scored")->capture_default_str();
  cmd->add_option("--seq", a->seq, "Tokens per row: longer documents are scored in pieces")
      ->capture_default_str();
  cmd->add_option("--batch", a->batch, "Rows per forward pass")->capture_default_str();
  cmd->add_option("--threads", a->threads, "Threads (default: all)");
  cmd->callback([a] {
    if (a->threads > 0) set_num_threads(a->threads);
    const model::Llama model(model::resolve_config(a->model), 0);
    eval::load_weights(model, a->checkpoint);
    for (const std::string& manifest : a->data) {
      const eval::PerplexityResult r =
          eval::perplexity(model, manifest, {a->split, a->seq, a->batch});
      nlohmann::ordered_json j{{"data", manifest},    {"split", a->split},
                               {"loss", r.loss},      {"perplexity", r.perplexity},
                               {"tokens", r.tokens},  {"documents", r.documents},
                               {"seconds", r.seconds}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
  });
}

}  // namespace pollen::cli
