// Whole training steps on the GPU against the same steps on the CPU: `pollen bench step`'s loop
// (forward, backward, clipping, AdamW; float32) with the same seed draws the same weights and
// tokens on both devices, so every step's loss must agree. Float32 GEMMs and reductions add in
// another order on the GPU; over ten steps the losses stay within 1e-3 of each other, relative
// (a wrong kernel moves them by far more within a step or two). The bf16 runs (f32 master
// weights and AdamW state) are held to the CPU's f32 losses too, more loosely.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda/gpu_compare.h"
#include "model/config.h"
#include "train/step_bench.h"

using namespace pollen;

namespace {

// compute: the GPU run's; the CPU runs f32. bf16 rounds weights, activations and gradients to 8
// significant bits, so its losses may drift further from the f32 ones: within 1e-2, relative.
void expect_same_losses(const model::LlamaConfig& config, int64_t batch, int64_t seq,
                        DType compute = DType::f32) {
  POLLEN_REQUIRE_GPU();
  const std::string& preset = config.name;
  train::StepBenchOptions o;
  o.batch = batch;
  o.seq = seq;
  o.warmup = 0;
  o.steps = 10;
  o.seed = 7;
  const auto cpu = train::run_step_bench(config, o);
  o.device = Device::cuda;
  o.compute = compute;
  const auto gpu = train::run_step_bench(config, o);
  EXPECT_EQ(gpu.compute, dtype_name(compute));
  const double tolerance = compute == DType::bf16 ? 1e-2 : 1e-3;
  ASSERT_EQ(cpu.losses.size(), 10u);
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], tolerance * std::abs(cpu.losses[i]))
        << preset << ": step " << i + 1;
  }
  // The steps trained: the loss fell.
  EXPECT_LT(gpu.losses.back(), gpu.losses.front()) << preset;
  EXPECT_GT(gpu.peak_device_mb, 0) << preset;
  EXPECT_GE(gpu.peak_device_reserved_mb, gpu.peak_device_mb) << preset;
}

}  // namespace

TEST(CudaTraining, TenStepsOfLlamaTinyMatchTheCpu) {
  expect_same_losses(model::resolve_config("llama-tiny"), 4, 128);
}

TEST(CudaTraining, TenStepsOfLlamaCpuMatchTheCpu) {
  expect_same_losses(model::resolve_config("llama-cpu"), 2, 256);
}

TEST(CudaTraining, TenStepsWithAttentionBiasesMatchTheCpu) {
  // Biases on q, k and v (as Qwen2 has): the bias broadcast and its gradient are GEMMs with a
  // unit dimension.
  model::LlamaConfig config = model::resolve_config("llama-tiny");
  config.name = "llama-tiny with attention biases";
  config.attention_bias = true;
  expect_same_losses(config, 2, 64);
}

TEST(CudaTraining, TenBf16StepsWithF32MasterWeightsMatchTheCpu) {
  expect_same_losses(model::resolve_config("llama-tiny"), 4, 128, DType::bf16);
}

TEST(CudaTraining, TenBf16StepsWithAttentionBiasesMatchTheCpu) {
  model::LlamaConfig config = model::resolve_config("llama-tiny");
  config.name = "llama-tiny with attention biases";
  config.attention_bias = true;
  expect_same_losses(config, 2, 64, DType::bf16);
}
