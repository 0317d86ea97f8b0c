#include "train/trainer_optimizer.h"

#include "train/trainer.h"

namespace fs = std::filesystem;

namespace pollen::train {

TrainerOptimizer::TrainerOptimizer(const OptimizerSettings& optimizer, double grad_clip, int zero,
                                   double bucket_mb, bool bf16,
                                   const std::vector<std::pair<std::string, ag::Var>>& named,
                                   dist::Communicator* reduce_over)
    : named_(named) {
  std::vector<ag::Var> params;
  for (const auto& [n, v] : named) params.push_back(v);
  const optim::AdamWOptions ao = optimizer.adamw(grad_clip);
  // Several ranks: gradients reduced in buckets; with parallel.zero = 1 the optimizer's state
  // is sharded (ZeRO-1), else every rank holds all of it.
  if (reduce_over) {
    reducer_ = std::make_unique<dist::GradReducer>(
        *reduce_over, params, static_cast<int64_t>(bucket_mb * 1048576.0),
        zero == 1 ? dist::ReduceMode::reduce_scatter : dist::ReduceMode::all_reduce);
  }
  if (reducer_ && zero == 1) {
    zero_ = std::make_unique<dist::ZeroAdamW>(*reducer_, ao, decay_mask(named, optimizer.no_decay));
    if (bf16) zero_->compute_in_bf16();  // master blocks sharded too
  } else {
    adamw_.emplace(params, ao, decay_mask(named, optimizer.no_decay));
    if (bf16) adamw_->compute_in_bf16();  // on the GPU: the config requires it
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

std::vector<double> TrainerOptimizer::state_bytes_per_rank(dist::Communicator& comm) const {
  std::vector<double> bytes(static_cast<size_t>(comm.world()), 0.0);
  bytes[static_cast<size_t>(comm.rank())] = static_cast<double>(state_bytes());
  comm.all_reduce_sum(bytes, "the optimizer state sizes");
  return bytes;
}

// ZeRO-1: the whole f32 weights and moments are read on every rank, which keeps its blocks.
void TrainerOptimizer::load(const fs::path& dir, const model::Llama& model) {
  if (!zero_) return load_checkpoint(dir, model, *adamw_);
  std::vector<Tensor> weights;
  std::vector<std::pair<std::string, Tensor>> into;
  for (const auto& [name, p] : named_) {
    weights.push_back(Tensor::empty(p.shape(), DType::f32));
    into.emplace_back(name, weights.back());
  }
  load_checkpoint_tensors(dir / "model.safetensors", into);
  zero_->load_weights(weights);
  load_moments(dir);
}

void TrainerOptimizer::load_moments(const fs::path& dir) {
  // Replicated: into the optimizer's own tensors; sharded: whole f32 tensors in host memory on
  // every rank (the parameters may be bf16 copies on a GPU), then each rank keeps its blocks.
  OptimizerMoments m;
  if (zero_) {
    for (const auto& [name, p] : named_) {
      m.exp_avg.push_back(Tensor::empty(p.shape(), DType::f32));
      m.exp_avg_sq.push_back(Tensor::empty(p.shape(), DType::f32));
    }
  } else {
    m = moments_of(*adamw_);
  }
  load_optimizer_moments(dir, named_, m);
  if (!zero_) {
    adamw_->set_steps_taken(m.steps);
    return;
  }
  zero_->load_state(m.exp_avg, m.exp_avg_sq);
  zero_->set_steps_taken(m.steps);
}

OptimizerMoments TrainerOptimizer::moments(bool keep) {
  if (!zero_) return moments_of(*adamw_);
  OptimizerMoments m;
  zero_->gather_state(m.exp_avg, m.exp_avg_sq, keep);
  m.steps = zero_->steps_taken();
  return m;
}

TrainerOptimizer::Gathered TrainerOptimizer::gather_for_checkpoint(bool keep) {
  Gathered g;
  if (!zero_) return g;
  g.moments = moments(keep);
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
