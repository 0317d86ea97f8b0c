// `pollen bench step`: training-step throughput on random tokens, one JSON line.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "model/config.h"
#include "train/step_bench.h"

namespace pollen::cli {

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Measure pollen's speed");
  bench->require_subcommand(1);
  auto* step = bench->add_subcommand(
      "step",
      "Full training steps (forward, backward, AdamW) on random tokens; prints one JSON "
      "line with tokens_per_s, step_ms, params, flops_per_token, gflops, peak_rss_mb");
  auto model = std::make_shared<std::string>("llama-tiny");
  auto opts = std::make_shared<train::StepBenchOptions>();
  step->add_option("--model", *model,
                   "Preset (llama-tiny, llama-cpu, llama-124m, llama-1b, "
                   "smollm2-135m) or a model .toml file")
      ->capture_default_str();
  step->add_option("--batch", opts->batch, "Sequences per step")->capture_default_str();
  step->add_option("--seq", opts->seq, "Tokens per sequence")->capture_default_str();
  step->add_option("--steps", opts->steps, "Timed steps")->capture_default_str();
  step->add_option("--warmup", opts->warmup, "Untimed steps first")->capture_default_str();
  step->add_option("--threads", opts->threads, "CPU threads (0: all)")->capture_default_str();
  step->add_option("--seed", opts->seed, "Seed for weights and tokens")->capture_default_str();
  step->add_flag("--recompute", opts->recompute, "Recompute each layer's activations in backward");
  step->callback([model, opts] {
    auto result = train::run_step_bench(model::resolve_config(*model), *opts);
    std::printf("%s\n", result.to_json().c_str());
  });
}

}  // namespace pollen::cli
