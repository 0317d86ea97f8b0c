#pragma once
// Throughput of full training steps (forward, backward, AdamW) on random tokens: what
// `pollen bench step` runs.
#include <cstdint>
#include <string>

#include <vector>

#include "model/config.h"
#include "tensor/device.h"
#include "tensor/dtype.h"
#include "train/private_gradients.h"

namespace pollen::train {

struct StepBenchOptions {
  int64_t batch = 8, seq = 128, steps = 10, warmup = 2;
  int threads = 0;  // 0: all hardware threads
  bool recompute = false;
  uint64_t seed = 0;
  Device device = Device::cpu;  // cuda: the model, its gradients and AdamW's state on the GPU
  // f32, or bf16 (GPU only): the model computes in bf16 while AdamW keeps f32 master weights.
  DType compute = DType::f32;
  bool profile = false;  // time the timed steps op by op (ops/profile.h)
  // > 0: DP-SGD steps (optim/dp_sgd.h): every row's gradient clipped to dp_clip on its own, and
  // N(0, (dp_noise dp_clip)^2) added to their sum (CPU, f32).
  double dp_clip = 0, dp_noise = 0;
  ClipMethod dp_clipping = ClipMethod::automatic;  // how each row is clipped
};

// One op's share of a timed step (with StepBenchOptions::profile).
struct StepOpTime {
  std::string op;
  double calls_per_step = 0, ms_per_step = 0;
};

struct StepBenchResult {
  std::string model;
  int threads = 0;
  int64_t params = 0, batch = 0, seq = 0, steps = 0;
  double step_ms = 0, cpu_ms = 0, tokens_per_s = 0, flops_per_token = 0, gflops = 0, last_loss = 0;
  double peak_rss_mb = 0;
  std::string device = "cpu", compute = "f32";
  double peak_device_mb = 0;           // the device allocator's peak of bytes in tensors
  double peak_device_reserved_mb = 0;  // its peak of bytes held (in tensors and cached)
  std::vector<double> losses;     // every step's loss, warm-up steps first (same seed: same data)
  std::vector<StepOpTime> ops;    // with profile: the ops by time, most first
  std::string to_json() const;    // one line
  std::string ops_table() const;  // with profile: the ops as a text table, the rest as "other"
};

StepBenchResult run_step_bench(const model::LlamaConfig& config, const StepBenchOptions& options);

}  // namespace pollen::train
