#include "train/step_bench.h"

#include <sys/resource.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/rng.h"
#include "base/thread_pool.h"
#include "model/llama.h"
#include "ops/profile.h"
#include "optim/adamw.h"
#include "optim/dp_sgd.h"
#include "tensor/allocator.h"
#include "tensor/cuda_memory.h"

namespace pollen::train {
namespace {
double cpu_seconds() {  // user + system time of every thread of this process
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}
}  // namespace

std::string StepBenchResult::to_json() const {
  nlohmann::ordered_json j;
  j["model"] = model;
  j["threads"] = threads;
  j["params"] = params;
  j["batch"] = batch;
  j["seq"] = seq;
  j["steps"] = steps;
  j["step_ms"] = std::round(step_ms * 10) / 10;
  j["cpu_ms"] = std::round(cpu_ms * 10) / 10;
  j["tokens_per_s"] = std::round(tokens_per_s);
  j["flops_per_token"] = flops_per_token;
  j["gflops"] = std::round(gflops * 10) / 10;
  j["loss"] = std::round(last_loss * 1000) / 1000;
  j["peak_rss_mb"] = std::round(peak_rss_mb);
  j["device"] = device;
  j["compute"] = compute;
  j["peak_device_mb"] = std::round(peak_device_mb);
  j["peak_device_reserved_mb"] = std::round(peak_device_reserved_mb);
  j["losses"] = losses;
  if (!ops.empty()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const StepOpTime& o : ops)
      list.push_back({{"op", o.op},
                      {"calls_per_step", o.calls_per_step},
                      {"ms_per_step", std::round(o.ms_per_step * 1000) / 1000}});
    j["ops"] = list;
  }
  return j.dump();
}

std::string StepBenchResult::ops_table() const {
  std::string out = "op                       calls/step   ms/step   share\n";
  double covered = 0;
  auto row = [&](const std::string& op, const std::string& calls, double ms) {
    char line[128];
    std::snprintf(line, sizeof line, "%-24s %11s %9.3f %6.1f%%\n", op.c_str(), calls.c_str(), ms,
                  step_ms > 0 ? 100 * ms / step_ms : 0.0);
    out += line;
  };
  for (const StepOpTime& o : ops) {
    char calls[32];
    std::snprintf(calls, sizeof calls, "%.0f", o.calls_per_step);
    row(o.op, calls, o.ms_per_step);
    covered += o.ms_per_step;
  }
  row("other", "", step_ms - covered);
  return out;
}

StepBenchResult run_step_bench(const model::LlamaConfig& config, const StepBenchOptions& o) {
  POLLEN_CHECK(o.batch > 0 && o.seq > 0 && o.steps > 0, "bench step: batch, seq and steps must ",
               "be positive");
  POLLEN_CHECK(o.seq <= config.max_position_embeddings, "bench step: --seq ", o.seq,
               " is more than the model's max_position_embeddings (",
               config.max_position_embeddings, "); expected 1 to that");
  set_num_threads(o.threads > 0 ? o.threads : available_cpus());
  model::Llama model(config, o.seed);
  model.to(o.device);
  model.set_recompute(o.recompute);
  const bool gpu = o.device == Device::cuda;
  optim::AdamW opt(model.parameters(), optim::AdamWOptions{});
  if (o.compute == DType::bf16) {
    POLLEN_CHECK(gpu, "bench step: bf16 compute runs on the GPU only (--device cuda)");
    opt.compute_in_bf16();
  } else {
    POLLEN_CHECK(o.compute == DType::f32, "bench step: compute dtype must be f32 or bf16, got ",
                 dtype_name(o.compute));
  }

  Rng rng(o.seed + 1);
  Tensor tokens = Tensor::empty({o.batch, o.seq}, DType::i32);
  Tensor targets = Tensor::empty({o.batch, o.seq}, DType::i32);
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    tokens.data<int32_t>()[i] =
        static_cast<int32_t>(rng.below(static_cast<uint64_t>(config.vocab_size)));
    targets.data<int32_t>()[i] =
        static_cast<int32_t>(rng.below(static_cast<uint64_t>(config.vocab_size)));
  }
  const model::Batch batch = model::Batch::contiguous_rows(tokens, targets);
  std::optional<optim::DpSgd> dp;
  if (o.dp_clip > 0) {
    POLLEN_CHECK(!gpu, "bench step: --dp-clip runs on the CPU only");
    // Every row in every step (q = 1): the cost of a step, not a privacy guarantee.
    dp.emplace(optim::DpSgdOptions{.enabled = true,
                                   .clip = o.dp_clip,
                                   .noise_multiplier = o.dp_noise,
                                   .delta = 1e-5,
                                   .noise_seed = static_cast<int64_t>(o.seed)},
               o.batch, o.batch, o.warmup + o.steps);
  }

  double loss = 0;
  std::vector<double> losses;
  std::optional<ops::OpProfile> profile;  // active over the timed steps alone
  auto one_step = [&] {
    if (dp) {
      dp->begin(model.parameters());
      const ClippedRows c = add_clipped_rows(model, batch, *dp, o.batch, o.dp_clipping);
      dp->release(static_cast<int64_t>(losses.size()) + 1);
      loss = c.loss_sum / static_cast<double>(c.scored);
    } else {
      ag::Tape tape;
      ag::Var l;
      {
        ag::TapeScope scope(tape);
        l = model.loss(batch);
      }
      tape.backward(l);
      loss = l.value().item();  // computed on the host; the GPU may still be stepping
    }
    opt.step(3e-4);
    opt.zero_grad();
    if (gpu) cuda::synchronize();
    if (profile) profile->settle();  // the GPU is done: reading its events waits for nothing
    losses.push_back(loss);
  };
  for (int64_t i = 0; i < o.warmup; ++i) one_step();
  // The peaks of the timed steps, on the device that holds the step's tensors.
  if (gpu) {
    CudaAllocator::instance().reset_peak();
  } else {
    CpuAllocator::instance().reset_peak();
  }
  if (o.profile) profile.emplace();
  const double cpu0 = cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < o.steps; ++i) one_step();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(o.steps);
  const double cpu_per_step = (cpu_seconds() - cpu0) / static_cast<double>(o.steps);

  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  StepBenchResult r;
  r.model = config.name;
  r.threads = num_threads();
  r.params = config.parameter_count();
  r.batch = o.batch;
  r.seq = o.seq;
  r.steps = o.steps;
  r.step_ms = seconds * 1e3;
  r.cpu_ms = cpu_per_step * 1e3;
  r.tokens_per_s = static_cast<double>(o.batch * o.seq) / seconds;
  r.flops_per_token = config.flops_per_token(o.seq);
  r.gflops = r.tokens_per_s * r.flops_per_token / 1e9;
  r.last_loss = loss;
  r.peak_rss_mb = static_cast<double>(ru.ru_maxrss) / 1024.0;
  r.device = device_name(o.device);
  r.compute = dtype_name(o.compute);
  const AllocatorStats memory =
      gpu ? CudaAllocator::instance().stats() : CpuAllocator::instance().stats();
  r.peak_device_mb = static_cast<double>(memory.peak_in_use_bytes) / (1 << 20);
  r.peak_device_reserved_mb = static_cast<double>(memory.peak_reserved_bytes) / (1 << 20);
  r.losses = std::move(losses);
  if (profile) {
    for (const ops::OpProfile::Entry& e : profile->entries()) {
      const double steps = static_cast<double>(o.steps);
      r.ops.push_back({e.op, static_cast<double>(e.calls) / steps, e.ms / steps});
    }
  }
  return r;
}

}  // namespace pollen::train
