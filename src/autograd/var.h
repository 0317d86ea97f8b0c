#pragma once
// A Var is a tensor that autograd tracks: its value, its gradient (allocated on first use and
// accumulated across backward passes until zero_grad), and whether it wants one.
#include <memory>
#include <string>

#include "tensor/tensor.h"

namespace pollen::ag {

// The tape's closures hold the nodes of their inputs and outputs for the gradients alone: what a
// backward step reads of a value it captures as a Tensor. So an op's output (a non-leaf) gives
// its value back once no Var holds it, and only what backward reads stays in memory (a
// projection's output that a residual add consumes, a query before rotary, ...).
struct VarNode {
  Tensor value;  // undefined once released
  Tensor grad;   // undefined until a backward pass reaches this Var
  bool requires_grad = false;
  bool is_leaf = true;  // made by the user (parameters, inputs); op outputs are not leaves
  std::string name;

  // The value's shape, dtype and device, also after its release: what a gradient must be.
  const Shape& shape() const { return value.defined() ? value.shape() : released_.shape; }
  DType dtype() const { return value.defined() ? value.dtype() : released_.dtype; }
  Device device() const { return value.defined() ? value.device() : released_.device; }
  // Drops the value, keeping what shape(), dtype() and device() return.
  void release_value();

 private:
  struct Spec {
    Shape shape;
    DType dtype = DType::f32;
    Device device = Device::cpu;
  } released_;
};

class Var {
 public:
  Var() = default;
  explicit Var(Tensor value, bool requires_grad = false, std::string name = {});

  bool defined() const { return node_ != nullptr; }
  const Tensor& value() const { return node_->value; }
  Tensor& value() { return node_->value; }
  const Tensor& grad() const { return node_->grad; }
  Tensor& grad() { return node_->grad; }
  bool requires_grad() const { return node_ && node_->requires_grad; }
  const std::string& name() const { return node_->name; }
  const Shape& shape() const { return node_->value.shape(); }
  int64_t size(int64_t d) const { return node_->value.size(d); }
  DType dtype() const { return node_->value.dtype(); }

  void zero_grad() { node_->grad = Tensor(); }
  const std::shared_ptr<VarNode>& node() const { return node_; }

 private:
  // Shared by a Var and its copies: the last one gone releases a non-leaf's value.
  struct Holder {
    std::shared_ptr<VarNode> node;
    ~Holder();
  };
  std::shared_ptr<Holder> holder_;
  std::shared_ptr<VarNode> node_;  // holder_->node, kept here for cheap access
};

}  // namespace pollen::ag
