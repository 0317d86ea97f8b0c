// LocalTrainer's inner AdamW moments: gathered after a ZeRO-1 round, read for the client's
// state, and the second and first moments shared with the federation (in AdamW's estimate's
// scale) and set back from its average.
#include "fed/client.h"

#include <cmath>

#include "fed/first_moments.h"
#include "fed/second_moments.h"

namespace pollen::fed {

void LocalTrainer::gather_after_round() {
  const bool lead = comm_->rank() == 0;
  gathered_ = {};
  if (!config_.state_dir.empty()) {
    zero_->gather_state(gathered_.exp_avg, gathered_.exp_avg_sq, lead);
  } else if (!first_moment_specs_.empty()) {
    std::vector<bool> wanted(params_.size(), false);
    for (size_t i : moment_slots(first_moment_specs_)) wanted[i] = true;
    gathered_.exp_avg = zero_->gather_first_moments(wanted, lead);
  }
  gathered_.steps = zero_->steps_taken();
  gathered_factored_ = share_moments_ ? sharded_factored_second_moments() : std::vector<float>{};
  if (!lead) {  // took part; keeps nothing
    gathered_ = {};
    gathered_factored_.clear();
  }
}

std::vector<float> LocalTrainer::sharded_factored_second_moments() {
  const ParamSpecs specs = exchanged_specs();
  std::vector<double> sums(static_cast<size_t>(factored_size(specs)), 0.0);
  for (const auto& block : zero_->blocks()) {
    const Tensor& v = block.exp_avg_sq;
    const Tensor host = v.cpu();
    add_factor_sums(specs, block.param, block.in_param, host.data<float>(), host.numel(), sums);
  }
  comm_->all_reduce_sum(sums, "the factored second moments");
  return factor_means(specs, sums);
}

train::OptimizerMoments LocalTrainer::optimizer_moments() {
  if (zero_) {
    POLLEN_CHECK(!gathered_.exp_avg_sq.empty(), "client '", config_.id,
                 "': no inner optimizer state gathered yet (rank ", comm_->rank(), ")");
    return gathered_;
  }
  train::OptimizerMoments m;
  for (const auto& slot : opt_->slots()) {
    m.exp_avg.push_back(slot.exp_avg.cpu());
    m.exp_avg_sq.push_back(slot.exp_avg_sq.cpu());
  }
  m.steps = opt_->steps_taken();
  return m;
}

double LocalTrainer::second_moment_bias() const {
  const int64_t steps = zero_ ? zero_->steps_taken() : opt_->steps_taken();
  return 1.0 - std::pow(config_.train.optimizer.beta2, static_cast<double>(steps));
}

std::vector<float> LocalTrainer::factored_second_moments() {
  std::vector<float> f;
  if (zero_) {
    POLLEN_CHECK(share_moments_ && !gathered_factored_.empty(), "client '", config_.id,
                 "': no second moments gathered after the round (rank ", comm_->rank(), ")");
    f = gathered_factored_;
  } else {
    std::vector<Tensor> host;
    for (const auto& slot : opt_->slots()) host.push_back(slot.exp_avg_sq.cpu());
    std::vector<const Tensor*> v;
    for (const Tensor& t : host) v.push_back(&t);
    f = factor_second_moments(exchanged_specs(), v);
  }
  // AdamW's estimate v / (1 - beta2^t), so that clients of another age agree on its scale.
  const double bias = second_moment_bias();
  for (float& x : f) x = bias > 0 ? static_cast<float>(x / bias) : 0.0f;
  return f;
}

void LocalTrainer::set_second_moments(const std::vector<float>& factored) {
  // Stored so that AdamW's estimate is the federation's: v / (1 - beta2^t) = shared. A client
  // that has not stepped yet (t = 0) keeps its empty moments, as AdamW starts.
  const auto bias = static_cast<float>(second_moment_bias());
  const auto scale = [bias](Tensor& t) {
    float* x = t.data<float>();
    for (int64_t j = 0; j < t.numel(); ++j) x[j] *= bias;
  };
  const ParamSpecs specs = exchanged_specs();
  if (!zero_) {
    // Expanded in host memory (the moments themselves on the CPU), then copied to the GPU.
    std::vector<Tensor> host;  // every value is rewritten: GPU moments need not come over
    for (auto& slot : opt_->slots()) {
      const Tensor& m = slot.exp_avg_sq;
      host.push_back(m.device() == Device::cpu ? m : Tensor::empty(m.shape(), DType::f32));
    }
    std::vector<Tensor*> v;
    for (Tensor& t : host) v.push_back(&t);
    expand_second_moments(specs, factored, v);
    for (size_t i = 0; i < host.size(); ++i) {
      scale(host[i]);
      Tensor& target = opt_->slots()[i].exp_avg_sq;
      if (!target.shares_storage(host[i])) target.copy_(host[i]);
    }
    return;
  }
  // ZeRO-1: each rank rebuilds its own blocks alone.
  for (const auto& block : zero_->blocks()) {
    Tensor v = Tensor::empty({block.exp_avg_sq.numel()}, DType::f32);
    expand_second_moments_range(specs, factored, block.param, block.in_param, v.numel(),
                                v.data<float>());
    scale(v);
    Tensor target = block.exp_avg_sq;  // a view into the optimizer's state
    target.copy_(v);
  }
}

double LocalTrainer::first_moment_bias() const {
  const int64_t steps = zero_ ? zero_->steps_taken() : opt_->steps_taken();
  return 1.0 - std::pow(config_.train.optimizer.beta1, static_cast<double>(steps));
}

std::vector<size_t> LocalTrainer::moment_slots(const ParamSpecs& moments) const {
  const auto named = model_.named_parameters();
  std::vector<size_t> slots;
  for (const auto& m : moments) {
    const std::string name = moment_tensor_name(m);
    size_t i = 0;
    while (i < named.size() && named[i].first != name) ++i;
    POLLEN_CHECK(i < named.size(), "client '", config_.id, "': the model has no tensor '", name,
                 "' for its first moments");
    slots.push_back(i);
  }
  return slots;
}

Weights LocalTrainer::first_moments(const ParamSpecs& moments) const {
  const std::vector<size_t> slots = moment_slots(moments);
  for (size_t k = 0; k < slots.size(); ++k) {
    POLLEN_CHECK(
        !zero_ || (slots[k] < gathered_.exp_avg.size() && gathered_.exp_avg[slots[k]].defined()),
        "client '", config_.id, "': the first moments of '", moment_tensor_name(moments[k]),
        "' were not gathered after the round (rank ", comm_->rank(), ")");
  }
  const double bias = first_moment_bias();
  Weights out;
  for (size_t i : slots) {
    const Tensor m = zero_ ? gathered_.exp_avg[i] : opt_->slots()[i].exp_avg.cpu();
    Tensor e = Tensor::empty(m.shape(), DType::f32);
    const float* x = m.data<float>();
    float* o = e.data<float>();
    for (int64_t j = 0; j < m.numel(); ++j)
      o[j] = bias > 0 ? static_cast<float>(x[j] / bias) : 0.0f;
    out.push_back(std::move(e));
  }
  return out;
}

void LocalTrainer::set_first_moments(const ParamSpecs& moments, const Weights& estimate) {
  const std::vector<size_t> slots = moment_slots(moments);
  POLLEN_ASSERT(estimate.size() == slots.size());
  // m = estimate (1 - beta1^t), so that AdamW's m / (1 - beta1^t) is the federation's. With
  // ZeRO-1 the whole tensors are built on every rank, which keeps its blocks of them.
  const auto bias = static_cast<float>(first_moment_bias());
  std::vector<Tensor> whole(params_.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    Tensor m = Tensor::empty(estimate[k].shape(), DType::f32);
    const float* e = estimate[k].data<float>();
    float* x = m.data<float>();
    for (int64_t j = 0; j < m.numel(); ++j) x[j] = e[j] * bias;
    if (!zero_) {
      Tensor& target = opt_->slots()[slots[k]].exp_avg;
      POLLEN_ASSERT(target.shape() == m.shape());
      target.copy_(m);  // into host or GPU memory
    }
    whole[slots[k]] = std::move(m);
  }
  if (zero_) zero_->load_first_moments(whole);
}

}  // namespace pollen::fed
