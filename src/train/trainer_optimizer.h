#pragma once
// The optimizer of a training run (pollen train's, and post-training's over the parameters it
// trains), replicated or sharded: AdamW whose state every rank holds whole, or with
// parallel.zero = 1 dist::ZeroAdamW (ZeRO-1), each rank keeping its blocks alone. With several
// ranks it owns the dist::GradReducer that reduces the gradients in buckets. Either way a
// checkpoint holds the whole state, so that a run resumes at any world size.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "dist/zero_adamw.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "train/config.h"
#include "train/trainer_checkpoint.h"

namespace pollen::train {

class TrainerOptimizer {
 public:
  // AdamW over `named` (the parameters trained, where they live) as [optimizer],
  // train.grad_clip and [parallel] (`zero`, `bucket_mb`) set it, in bf16 with f32 master weights
  // when `bf16`; `reduce_over`: the ranks whose gradients are reduced, null for a process alone.
  TrainerOptimizer(const OptimizerSettings& optimizer, double grad_clip, int zero, double bucket_mb,
                   bool bf16, const std::vector<std::pair<std::string, ag::Var>>& named,
                   dist::Communicator* reduce_over);
  // The same as a pre-training run's config sets it.
  TrainerOptimizer(const TrainConfig& cfg,
                   const std::vector<std::pair<std::string, ag::Var>>& named,
                   dist::Communicator* reduce_over)
      : TrainerOptimizer(cfg.optimizer, cfg.grad_clip, cfg.zero, cfg.bucket_mb,
                         cfg.precision == "bf16", named, reduce_over) {}

  bool sharded() const { return zero_ != nullptr; }
  dist::GradReducer* reducer() { return reducer_.get(); }  // null for a process alone

  // One update with learning rate `lr`; returns the gradient norm before clipping.
  double step(double lr);
  // Seconds the last step waited for ZeRO-1's all-gather of the parameters (0 when replicated).
  double last_wait_s() const { return zero_ ? zero_->last_wait_s() : 0.0; }
  void zero_grad();
  // Bytes of optimizer state this rank holds.
  int64_t state_bytes() const;
  // Every rank's state_bytes(), in rank order (a collective over `comm`).
  std::vector<double> state_bytes_per_rank(dist::Communicator& comm) const;

  // Loads `model`'s weights and the optimizer's state from a checkpoint folder.
  void load(const std::filesystem::path& dir, const model::Llama& model);
  // The optimizer's state alone from a checkpoint folder (for runs that load their weights
  // themselves); sharded, each rank keeps its blocks.
  void load_moments(const std::filesystem::path& dir);
  // The whole moments as a checkpoint holds them. Sharded, a collective that every rank calls,
  // whose result only a rank that passes `keep` holds.
  OptimizerMoments moments(bool keep);

  // ZeRO-1's state as a checkpoint holds it: the whole weights and moments.
  struct Gathered {
    CheckpointTensors weights{"model.safetensors", {}};
    std::vector<std::string> trained;
    OptimizerMoments moments;
  };
  // A collective under ZeRO-1 (every rank calls it): every rank's blocks gathered, which only a
  // rank that passes `keep` holds after. Replicated, nothing: the optimizer's own state is
  // written.
  Gathered gather_for_checkpoint(bool keep);
  CheckpointWritten write_checkpoint(const std::filesystem::path& root, int64_t step,
                                     const model::Llama& model, const Gathered& gathered,
                                     const nlohmann::ordered_json& state,
                                     const std::string& config_toml) const;

 private:
  std::vector<std::pair<std::string, ag::Var>> named_;
  std::unique_ptr<dist::GradReducer> reducer_;
  std::unique_ptr<dist::ZeroAdamW> zero_;  // parallel.zero = 1 with several ranks
  std::optional<optim::AdamW> adamw_;      // else
};

}  // namespace pollen::train
