#pragma once
// The pre-training loop behind `pollen train`: gradient accumulation over micro-batches with the
// loss a mean over every scored token of the global batch, AdamW on a schedule, evaluation,
// checkpoints that resume bitwise, metrics (JSONL + TensorBoard), preemption by SIGINT/SIGTERM
// and a stop after too many non-finite losses in a row.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "train/config.h"

namespace pollen::train {

// Exit codes of `pollen train` (docs/training.md): schedulers tell these apart.
enum class RunStatus { finished = 0, failed = 1, preempted = 3 };

struct TrainOptions {
  bool resume = false;
  bool handle_signals = true;  // SIGINT/SIGTERM: finish the step, checkpoint, stop
  // Tests: behave as if preempted once this many steps have run in this process (-1: never).
  int64_t stop_after = -1;
  bool quiet = false;  // no progress lines (tests)
};

struct TrainResult {
  RunStatus status = RunStatus::finished;
  int64_t step = 0, tokens = 0, skipped_steps = 0;
  double last_loss = 0, last_val_loss = 0;
  std::filesystem::path last_checkpoint;
  std::string message;
};

TrainResult run_training(const TrainConfig& config, const TrainOptions& options);

// Scored targets (>= 0) in a batch.
int64_t count_scored(const model::Batch& batch);

struct AccumulatedLoss {
  double loss = 0;  // mean over every scored token of all micro-batches
  int64_t scored = 0;
};
// Forward and backward of each micro-batch with the loss summed and its gradient scaled by
// 1 / (scored tokens of all micro-batches): the parameters' gradients become those of the mean
// over the whole global batch, whatever each micro-batch scores.
AccumulatedLoss accumulate_gradients(const model::Llama& model,
                                     const std::vector<model::Batch>& micro_batches);

// Whether weight decay applies to each parameter (named as HF names them), given the no-decay
// groups "norms", "biases" and "embeddings".
std::vector<bool> decay_mask(const std::vector<std::pair<std::string, ag::Var>>& params,
                             const std::vector<std::string>& no_decay);

// This machine's f32 GEMM rate on pollen's thread pool (FLOP/s), MFU's default peak.
double measure_peak_flops();

// A checkpoint of a model and its optimizer: model.safetensors (HF names), optimizer.safetensors
// (<name>.exp_avg, <name>.exp_avg_sq; metadata "step"), plus the given JSON state and config.
struct CheckpointWritten {
  std::filesystem::path dir;
  io::WriteStats stats;
  double seconds = 0;
};
CheckpointWritten write_checkpoint(const std::filesystem::path& root, int64_t step,
                                   const model::Llama& model, const optim::AdamW& opt,
                                   const nlohmann::ordered_json& state,
                                   const std::string& config_toml);
// Loads weights and optimizer state from a checkpoint folder (names and shapes must match).
void load_checkpoint(const std::filesystem::path& dir, const model::Llama& model,
                     optim::AdamW& opt);

}  // namespace pollen::train
