// `pollen bench step` (training-step throughput on random tokens) and `pollen bench gemm`
// (the GEMM ceiling), each printing one JSON line.
#include <cstdio>
#include <map>
#include <memory>

#include "base/thread_pool.h"
#include "cli/commands.h"
#include "model/config.h"
#include "ops/gemm_ceiling.h"
#include "train/step_bench.h"

namespace pollen::cli {

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Measure pollen's speed");
  bench->require_subcommand(1);
  auto* step = bench->add_subcommand(
      "step",
      "Full training steps (forward, backward, AdamW) on random tokens; prints one JSON "
      "line with tokens_per_s, step_ms, params, flops_per_token, gflops, peak_rss_mb, "
      "peak_device_mb and peak_device_reserved_mb (the peaks in tensors and held by the "
      "allocator of the step's device), the compute dtype and every step's loss");
  auto model = std::make_shared<std::string>("llama-tiny");
  auto opts = std::make_shared<train::StepBenchOptions>();
  auto device = std::make_shared<std::string>("cpu");
  auto compute = std::make_shared<std::string>("f32");
  step->add_option("--model", *model,
                   "Preset (llama-tiny, llama-cpu, llama-124m, llama-1b, "
                   "smollm2-135m) or a model .toml file")
      ->capture_default_str();
  step->add_option("--batch", opts->batch, "Sequences per step")->capture_default_str();
  step->add_option("--seq", opts->seq, "Tokens per sequence")->capture_default_str();
  step->add_option("--steps", opts->steps, "Timed steps")->capture_default_str();
  step->add_option("--warmup", opts->warmup, "Untimed steps first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  step->add_option("--threads", opts->threads, "CPU threads (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  step->add_option("--seed", opts->seed, "Seed for weights and tokens")
      ->check(seed_number())
      ->capture_default_str();
  step->add_flag("--recompute", opts->recompute, "Recompute each layer's activations in backward");
  step->add_option("--device", *device,
                   "cpu, or cuda: the model, gradients and AdamW state on the GPU")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  step->add_option("--compute", *compute,
                   "f32, or bf16 (cuda only): bf16 weights, activations and gradients, with "
                   "f32 master weights and AdamW state")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  step->add_flag("--profile", opts->profile,
                 "Time the timed steps op by op (GPU time on cuda): a table on stderr, and the "
                 "JSON line's \"ops\" (calls and ms per step of each op, the most time first)");
  auto* dp_clip =
      step->add_option(
              "--dp-clip", opts->dp_clip,
              "DP-SGD steps (CPU): each row's gradient clipped to this L2 norm on its own, "
              "then noised (0: plain steps)")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
  step->add_option("--dp-noise", opts->dp_noise,
                   "With --dp-clip: the noise multiplier z (noise std z times the clip)")
      ->check(CLI::NonNegativeNumber)
      ->needs(dp_clip)
      ->capture_default_str();
  const std::map<std::string, train::ClipMethod> clippings{
      {"auto", train::ClipMethod::automatic},
      {"batched", train::ClipMethod::batched},
      {"one-by-one", train::ClipMethod::one_by_one}};
  step->add_option("--dp-clipping", opts->dp_clipping,
                   "With --dp-clip: batched (every row's norm in one forward and backward), "
                   "one-by-one (a forward and backward per row), or auto (the one estimated "
                   "cheaper, as pollen train chooses)")
      ->transform(CLI::CheckedTransformer(clippings, CLI::ignore_case))
      ->needs(dp_clip)
      ->capture_default_str();
  step->callback([model, opts, device, compute] {
    POLLEN_CHECK(opts->dp_noise == 0 || opts->dp_clip > 0,
                 "--dp-noise needs a positive --dp-clip (--dp-clip 0 runs plain steps)");
    opts->device = parse_device(*device);
    opts->compute = *compute == "bf16" ? DType::bf16 : DType::f32;
    auto result = train::run_step_bench(model::resolve_config(*model), *opts);
    if (opts->profile) std::fprintf(stderr, "%s", result.ops_table().c_str());
    std::printf("%s\n", result.to_json().c_str());
  });

  auto* gemm = bench->add_subcommand(
      "gemm", "The f32 GEMM ceiling as pollen runs it (square products); prints one JSON line");
  auto size = std::make_shared<int64_t>(2048);
  auto reps = std::make_shared<int>(5);
  auto threads = std::make_shared<int>(0);
  gemm->add_option("--size", *size, "Matrix size (1 to 32768)")
      ->check(CLI::Range(int64_t{1}, int64_t{32768}))
      ->capture_default_str();
  gemm->add_option("--reps", *reps, "Timed repetitions (the best is reported)")
      ->check(one_or_more())
      ->capture_default_str();
  gemm->add_option("--threads", *threads, "CPU threads (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  gemm->callback([size, reps, threads] {
    if (*threads > 0) set_num_threads(*threads);
    const auto c = ops::measure_gemm_ceiling(*size, *reps);
    std::printf("{\"size\":%lld,\"threads\":%d,\"gflops\":%.1f}\n", static_cast<long long>(c.size),
                c.threads, c.gflops);
  });
}

}  // namespace pollen::cli
