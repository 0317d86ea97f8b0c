// `pollen train` on the GPU (run.device = "cuda") over the trainer tests' tiny dataset: in f32 its
// losses follow the CPU run's; in bf16 (run.precision = "bf16") its checkpoints hold the f32
// master weights, and a run preempted and resumed from one ends bitwise equal to a run that was
// never stopped.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>

#include "base/hash.h"
#include "cuda/gpu_compare.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "train/config.h"
#include "train/run_checks.h"
#include "train/tiny_run.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pollen_cuda_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// The trainer tests' tiny model with one attention head of 32 (the GPU's attention takes head
// dimensions 32, 64 and 128), on either device.
train::TrainConfig tiny(const fs::path& run, const fs::path& data, int steps,
                        std::vector<std::string> sets) {
  sets.push_back("model.num_attention_heads=1");
  return train::parse_train_config(test_support::tiny_run_toml(run, data, steps), "tiny.toml",
                                   sets);
}

using test_support::train_quiet;

std::vector<double> train_losses(const fs::path& run) {
  std::vector<double> out;
  for (const auto& j : test_support::read_metrics(run))
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  return out;
}

std::string checkpoint_hash(const fs::path& run, int64_t step) {
  const fs::path c = run / "checkpoints" / io::checkpoint_name(step);
  return sha256_file(c / "model.safetensors") + sha256_file(c / "optimizer.safetensors");
}

}  // namespace

TEST(CudaTrainingRun, F32RunFollowsTheCpuRun) {
  POLLEN_REQUIRE_GPU();
  const fs::path base = temp_dir("f32_run");
  const fs::path data = test_support::make_tiny_dataset(base / "data");
  const auto cpu = train_quiet(tiny(base / "cpu", data, 8, {}));
  ASSERT_EQ(cpu.status, train::RunStatus::finished) << cpu.message;
  const auto gpu = train_quiet(tiny(base / "gpu", data, 8, {"run.device=\"cuda\""}));
  ASSERT_EQ(gpu.status, train::RunStatus::finished) << gpu.message;
  const auto a = train_losses(base / "cpu"), b = train_losses(base / "gpu");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-3 * a[i]) << "step " << i + 1;
  fs::remove_all(base);
}

TEST(CudaTrainingRun, Bf16RunCheckpointsF32MasterWeightsAndResumesBitwise) {
  POLLEN_REQUIRE_GPU();
  const fs::path base = temp_dir("bf16_run");
  const fs::path data = test_support::make_tiny_dataset(base / "data");
  const std::vector<std::string> bf16 = {"run.device=\"cuda\"", "run.precision=\"bf16\""};
  const auto cpu = train_quiet(tiny(base / "cpu", data, 8, {}));
  ASSERT_EQ(cpu.status, train::RunStatus::finished) << cpu.message;
  const auto full = train_quiet(tiny(base / "full", data, 8, bf16));
  ASSERT_EQ(full.status, train::RunStatus::finished) << full.message;

  // The first step's loss comes before any update: bf16 rounding alone separates it from the
  // CPU's f32 loss. Then the run trains: its loss falls at least half as far as the CPU's.
  const auto f32_losses = train_losses(base / "cpu"), losses = train_losses(base / "full");
  ASSERT_EQ(losses.size(), 8u);
  ASSERT_EQ(f32_losses.size(), 8u);
  EXPECT_NEAR(losses[0], f32_losses[0], 1e-2 * f32_losses[0]);
  const double f32_fall = f32_losses.front() - f32_losses.back();
  EXPECT_GT(f32_fall, 0.0);
  EXPECT_GT(losses.front() - losses.back(), 0.5 * f32_fall);

  // The checkpoint holds f32 weights (the masters), not the bf16 copies.
  const auto weights = io::read_safetensors(base / "full/checkpoints" / io::checkpoint_name(8) /
                                            "model.safetensors");
  ASSERT_FALSE(weights.tensors.empty());
  for (const auto& [name, t] : weights.tensors) EXPECT_EQ(t.dtype(), DType::f32) << name;

  // Preempted after 5 steps, resumed: the same losses and the same final checkpoint, bit for bit.
  const auto cut = tiny(base / "cut", data, 8, bf16);
  auto r = train_quiet(cut, false, 5);
  ASSERT_EQ(r.status, train::RunStatus::preempted) << r.message;
  r = train_quiet(cut, true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_EQ(train_losses(base / "cut"), losses);
  EXPECT_EQ(checkpoint_hash(base / "cut", 8), checkpoint_hash(base / "full", 8));

  fs::remove_all(base);
}
