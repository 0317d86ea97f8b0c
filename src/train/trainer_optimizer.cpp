#include "train/trainer_optimizer.h"

#include "train/trainer.h"

namespace fs = std::filesystem;

namespace pollen::train {

TrainerOptimizer::TrainerOptimizer(const TrainConfig& cfg,
                                   const std::vector<std::pair<std::string, ag::Var>>& named,
                                   dist::Communicator* reduce_over)
    : named_(named) {
  std::vector<ag::Var> params;
  for (const auto& [n, v] : named) params.push_back(v);
  const optim::AdamWOptions ao = cfg.optimizer.adamw(cfg.grad_clip);
  // Several ranks: gradients reduced in buckets; with parallel.zero = 1 the optimizer's state
  // is sharded (ZeRO-1), else every rank holds all of it.
  if (reduce_over) {
    reducer_ = std::make_unique<dist::GradReducer>(
        *reduce_over, params, static_cast<int64_t>(cfg.bucket_mb * 1048576.0),
        cfg.zero == 1 ? dist::ReduceMode::reduce_scatter : dist::ReduceMode::all_reduce);
  }
  if (reducer_ && cfg.zero == 1) {
    zero_ =
        std::make_unique<dist::ZeroAdamW>(*reducer_, ao, decay_mask(named, cfg.optimizer.no_decay));
    if (cfg.precision == "bf16") zero_->compute_in_bf16();  // master blocks sharded too
  } else {
    adamw_.emplace(params, ao, decay_mask(named, cfg.optimizer.no_decay));
    if (cfg.precision == "bf16") adamw_->compute_in_bf16();  // on the GPU: the config requires it
  }
}

double TrainerOptimizer::step(double lr) {
  return zero_ ? zero_->step(lr) : adamw_->step(lr);
}

void TrainerOptimizer::zero_grad() {
  for (auto& [name, p] : named_) p.zero_grad();
}

int64_t TrainerOptimizer::state_bytes() const {
  return zero_ ? zero_->state_bytes() : adamw_->state_bytes();
}

// ZeRO-1: the whole f32 weights and moments are read on every rank, which keeps its blocks.
void TrainerOptimizer::load(const fs::path& dir, const model::Llama& model) {
  if (!zero_) return load_checkpoint(dir, model, *adamw_);
  std::vector<Tensor> weights;
  std::vector<std::pair<std::string, Tensor>> into;
  OptimizerMoments m;
  for (const auto& [name, p] : named_) {
    weights.push_back(Tensor::empty(p.shape(), DType::f32));
    into.emplace_back(name, weights.back());
    m.exp_avg.push_back(Tensor::empty(p.shape(), DType::f32));
    m.exp_avg_sq.push_back(Tensor::empty(p.shape(), DType::f32));
  }
  load_checkpoint_tensors(dir / "model.safetensors", into);
  load_optimizer_moments(dir, named_, m);
  zero_->load_weights(weights);
  zero_->load_state(m.exp_avg, m.exp_avg_sq);
  zero_->set_steps_taken(m.steps);
}

TrainerOptimizer::Gathered TrainerOptimizer::gather_for_checkpoint(bool keep) {
  Gathered g;
  if (!zero_) return g;
  zero_->gather_state(g.moments.exp_avg, g.moments.exp_avg_sq, keep);
  g.moments.steps = zero_->steps_taken();
  const std::vector<Tensor> whole = zero_->gather_weights(keep);
  for (size_t i = 0; i < named_.size(); ++i) {
    g.weights.tensors.emplace_back(named_[i].first, whole[i]);
    g.trained.push_back(named_[i].first);
  }
  return g;
}

CheckpointWritten TrainerOptimizer::write_checkpoint(const fs::path& root, int64_t step,
                                                     const model::Llama& model,
                                                     const Gathered& gathered,
                                                     const nlohmann::ordered_json& state,
                                                     const std::string& config_toml) const {
  if (!zero_) return train::write_checkpoint(root, step, model, *adamw_, state, config_toml);
  return train::write_checkpoint(root, step, {gathered.weights}, gathered.trained, gathered.moments,
                                 state, config_toml, {});
}

}  // namespace pollen::train
