#include "train/post_optimizer.h"

#include "train/trainer.h"

namespace pollen::train {

PostOptimizer::PostOptimizer(const PostConfig& cfg,
                             const std::vector<std::pair<std::string, ag::Var>>& trained,
                             dist::Communicator& comm)
    : trained_(trained) {
  std::vector<ag::Var> params;
  for (const auto& [n, v] : trained) params.push_back(v);
  const optim::AdamWOptions options = cfg.optimizer.adamw(cfg.grad_clip);
  const std::vector<bool> decay = decay_mask(trained, cfg.optimizer.no_decay);
  if (comm.world() > 1) {
    reducer_ = std::make_unique<dist::GradReducer>(
        comm, params, static_cast<int64_t>(cfg.bucket_mb * 1048576.0),
        cfg.zero == 1 ? dist::ReduceMode::reduce_scatter : dist::ReduceMode::all_reduce);
  }
  if (reducer_ && cfg.zero == 1)
    zero_ = std::make_unique<dist::ZeroAdamW>(*reducer_, options, decay);
  else
    adamw_.emplace(params, options, decay);
}

double PostOptimizer::step(double lr) {
  return zero_ ? zero_->step(lr) : adamw_->step(lr);
}

int64_t PostOptimizer::state_bytes() const {
  return zero_ ? zero_->state_bytes() : adamw_->state_bytes();
}

OptimizerMoments PostOptimizer::moments(bool keep) {
  if (!zero_) return moments_of(*adamw_);
  OptimizerMoments m;
  zero_->gather_state(m.exp_avg, m.exp_avg_sq, keep);
  m.steps = zero_->steps_taken();
  return m;
}

void PostOptimizer::load(const std::filesystem::path& dir) {
  if (!zero_) {
    OptimizerMoments m = moments_of(*adamw_);  // loaded in place
    load_optimizer_moments(dir, trained_, m);
    adamw_->set_steps_taken(m.steps);
    return;
  }
  OptimizerMoments m;  // whole, on every rank, which keeps its blocks
  load_optimizer_moments(dir, trained_, m);
  zero_->load_state(m.exp_avg, m.exp_avg_sq);
  zero_->set_steps_taken(m.steps);
}

}  // namespace pollen::train
