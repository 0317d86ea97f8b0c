#include "autograd/tape.h"

#include "ops/elementwise.h"

namespace pollen::ag {
namespace {
thread_local Tape* t_active = nullptr;
thread_local BackwardObserver* t_observer = nullptr;

void note_leaf(const std::shared_ptr<VarNode>& v) {
  if (t_observer && v->is_leaf) t_observer->leaf_written(v.get());
}
}  // namespace

void VarNode::release_value() {
  released_ = {value.shape(), value.dtype(), value.device()};
  value = Tensor();
}

Var::Var(Tensor value, bool requires_grad, std::string name)
    : holder_(std::make_shared<Holder>(Holder{std::make_shared<VarNode>()})) {
  VarNode& node = *holder_->node;
  node.value = std::move(value);
  node.requires_grad = requires_grad;
  node.name = std::move(name);
}

Var::Holder::~Holder() {
  // Recorded closures may still hold the node for its gradient; none reads its value.
  if (node && !node->is_leaf && node->value.defined()) node->release_value();
}

Tape* active_tape() {
  return t_active;
}

TapeScope::TapeScope(Tape& tape) : previous_(t_active) {
  t_active = &tape;
}
TapeScope::~TapeScope() {
  t_active = previous_;
}

NoGrad::NoGrad() : previous_(t_active) {
  t_active = nullptr;
}
NoGrad::~NoGrad() {
  t_active = previous_;
}

bool should_record(std::initializer_list<const Var*> inputs) {
  if (!t_active) return false;
  for (const Var* v : inputs)
    if (v && v->requires_grad()) return true;
  return false;
}

ObserveBackward::ObserveBackward(BackwardObserver& observer) : previous_(t_observer) {
  t_observer = &observer;
}
ObserveBackward::~ObserveBackward() {
  t_observer = previous_;
}

Tensor& grad_buffer(const std::shared_ptr<VarNode>& v) {
  note_leaf(v);
  if (!v->grad.defined()) {
    v->grad = Tensor::zeros(v->shape(), v->dtype(), v->device());
  }
  return v->grad;
}

void accumulate(const std::shared_ptr<VarNode>& v, const Tensor& g) {
  if (!v->requires_grad) return;
  note_leaf(v);
  if (!v->grad.defined()) {
    v->grad = g.shape() == v->shape() ? g : g.reshape(v->shape());
  } else {
    ops::axpy(1.0, g.reshape(v->shape()), v->grad);
  }
}

void Tape::backward(Var& loss, double seed) {
  POLLEN_CHECK(loss.value().numel() == 1, "backward: the loss must have one element, got shape ",
               shape_str(loss.shape()));
  POLLEN_CHECK(loss.requires_grad(), "backward: the loss does not depend on any parameter");
  backward(loss, Tensor::full(loss.shape(), seed, loss.dtype()));
}

void Tape::backward(Var& out, const Tensor& grad) {
  accumulate(out.node(), grad);
  while (!steps_.empty()) {
    auto step = std::move(steps_.back());
    steps_.pop_back();
    step();
    if (t_observer) t_observer->step_done();
  }
}

}  // namespace pollen::ag
