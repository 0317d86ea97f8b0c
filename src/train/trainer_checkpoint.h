#pragma once
// Checkpoints of a training run: model.safetensors (HF names), optimizer.safetensors (AdamW's
// moments, <name>.exp_avg and <name>.exp_avg_sq, metadata "step"), state.json and config.toml,
// written by io::CheckpointWriter and read back into a model and its optimizer. Pre-training
// (train/trainer.h), post-training and federated runs write and read them.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "model/llama.h"
#include "optim/adamw.h"

namespace pollen::train {

// A checkpoint of a model and its optimizer: model.safetensors (HF names), optimizer.safetensors
// (<name>.exp_avg, <name>.exp_avg_sq; metadata "step"), plus the given JSON state and config.
// The optimizer's parameters are the model's, in named_parameters() order. In mixed precision
// (AdamW::compute_in_bf16) the f32 master weights are written, and loaded back into them.
struct CheckpointWritten {
  std::filesystem::path dir;
  io::WriteStats stats;
  double seconds = 0;
};
CheckpointWritten write_checkpoint(const std::filesystem::path& root, int64_t step,
                                   const model::Llama& model, const optim::AdamW& opt,
                                   const nlohmann::ordered_json& state,
                                   const std::string& config_toml);
// Logs a checkpoint just written and removes the oldest under `root` beyond `keep` (0: none).
void log_checkpoint_and_retain(const std::filesystem::path& root, int64_t step,
                               const CheckpointWritten& written, int keep);
// Loads weights and optimizer state from a checkpoint folder (names and shapes must match).
void load_checkpoint(const std::filesystem::path& dir, const model::Llama& model,
                     optim::AdamW& opt);

// AdamW's state as a checkpoint holds it, whole, per parameter in model order; the form both
// a replicated and a sharded (ZeRO-1) optimizer write and read, so that a checkpoint resumes
// at any world size.
struct OptimizerMoments {
  std::vector<Tensor> exp_avg, exp_avg_sq;
  int64_t steps = 0;
};
CheckpointWritten write_checkpoint(const std::filesystem::path& root, int64_t step,
                                   const model::Llama& model, const OptimizerMoments& moments,
                                   const nlohmann::ordered_json& state,
                                   const std::string& config_toml);
// Loads weights and fills `moments` (allocated here) from a checkpoint folder.
void load_checkpoint(const std::filesystem::path& dir, const model::Llama& model,
                     OptimizerMoments& moments);
OptimizerMoments moments_of(const optim::AdamW& opt);  // sharing the optimizer's tensors

// The general form, for runs that train more or less than a whole model (post-training): the
// weight files (model.safetensors and any others) as given, AdamW's moments for the parameters
// named `trained` (in the optimizer's order), the JSON state and config, and text files copied
// in as they are (name, content).
struct CheckpointTensors {
  std::string file;  // "model.safetensors"
  io::NamedTensors tensors;
};
CheckpointWritten write_checkpoint(const std::filesystem::path& root, int64_t step,
                                   const std::vector<CheckpointTensors>& weights,
                                   const std::vector<std::string>& trained,
                                   const OptimizerMoments& moments,
                                   const nlohmann::ordered_json& state,
                                   const std::string& config_toml,
                                   const std::vector<std::pair<std::string, std::string>>& texts);
// Copies each named tensor of a checkpoint's safetensors file into the tensor given for it
// (shape and dtype must match).
void load_checkpoint_tensors(const std::filesystem::path& file,
                             const std::vector<std::pair<std::string, Tensor>>& into);
// AdamW's moments for `trained` and its step count from dir/optimizer.safetensors (`moments`
// allocated here when empty, else filled in place).
void load_optimizer_moments(const std::filesystem::path& dir,
                            const std::vector<std::pair<std::string, ag::Var>>& trained,
                            OptimizerMoments& moments);

}  // namespace pollen::train
