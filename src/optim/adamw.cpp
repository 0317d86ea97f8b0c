#include "optim/adamw.h"

#include <cmath>

namespace pollen::optim {

AdamW::AdamW(std::vector<ag::Var> params, const AdamWOptions& options)
    : params_(std::move(params)), options_(options) {
  for (const auto& p : params_) {
    ops::AdamWSlot s;
    s.param = p.value();
    s.exp_avg = Tensor::zeros(p.shape(), p.dtype(), p.value().device());
    s.exp_avg_sq = Tensor::zeros(p.shape(), p.dtype(), p.value().device());
    s.weight_decay = p.value().dim() >= 2 ? options_.weight_decay : 0.0;
    slots_.push_back(std::move(s));
  }
}

AdamW::AdamW(std::vector<ag::Var> params, const AdamWOptions& options,
             const std::vector<bool>& decay)
    : AdamW(std::move(params), options) {
  POLLEN_CHECK(decay.size() == slots_.size(), "AdamW: ", decay.size(), " decay flags for ",
               slots_.size(), " parameters");
  for (size_t i = 0; i < slots_.size(); ++i)
    slots_[i].weight_decay = decay[i] ? options_.weight_decay : 0.0;
}

void AdamW::compute_in_bf16() {
  for (size_t i = 0; i < params_.size(); ++i) {
    ag::Var& p = params_[i];
    ops::AdamWSlot& slot = slots_[i];
    if (slot.model_copy.defined()) continue;
    POLLEN_CHECK(p.value().device() == Device::cuda && p.dtype() == DType::f32,
                 "AdamW: bf16 compute needs f32 parameters on the GPU; parameter '", p.name(),
                 "' is ", dtype_name(p.dtype()), " on ", device_name(p.value().device()));
    slot.model_copy = p.value().to(DType::bf16);  // slot.param keeps the f32 tensor
    p.node()->value = slot.model_copy;
    p.node()->grad = Tensor();
  }
}

void AdamW::refresh_model_copies() {
  for (auto& slot : slots_)
    if (slot.model_copy.defined()) slot.model_copy.copy_(slot.param);
}

double grad_norm(const std::vector<ag::Var>& params) {
  std::vector<Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  return std::sqrt(ops::sum_of_squares(grads));
}

double AdamW::step(double lr) {
  const double norm = grad_norm(params_);
  if (!std::isfinite(norm)) return norm;
  ++step_;
  ops::AdamWHyper h;
  h.lr = lr;
  h.beta1 = options_.beta1;
  h.beta2 = options_.beta2;
  h.eps = options_.eps;
  h.step = step_;
  if (options_.max_grad_norm > 0 && norm > options_.max_grad_norm) {
    h.grad_scale = options_.max_grad_norm / (norm + 1e-6);
  }
  std::vector<ops::AdamWSlot> active;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    slots_[i].grad = params_[i].grad();
    active.push_back(slots_[i]);
  }
  ops::adamw_step(active, h);
  // The slots must not keep this step's gradients alive past zero_grad: the next backward would
  // allocate a second set beside them.
  for (auto& slot : slots_) slot.grad = Tensor();
  return norm;
}

void AdamW::zero_grad() {
  for (auto& p : params_) p.zero_grad();
}

}  // namespace pollen::optim
