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

  bool defined() const { return holder_ != nullptr; }
  const Tensor& value() const { return node()->value; }
  Tensor& value() { return node()->value; }
  const Tensor& grad() const { return node()->grad; }
  Tensor& grad() { return node()->grad; }
  bool requires_grad() const { return holder_ && node()->requires_grad; }
  const std::string& name() const { return node()->name; }
  const Shape& shape() const { return node()->value.shape(); }
  int64_t size(int64_t d) const { return node()->value.size(d); }
  DType dtype() const { return node()->value.dtype(); }

  void zero_grad() { node()->grad = Tensor(); }
  const std::shared_ptr<VarNode>& node() const { return holder_ ? holder_->node : kNoNode; }

 private:
  // Shared by a Var and its copies: the last one gone releases a non-leaf's value.
  struct Holder {
    std::shared_ptr<VarNode> node;
    ~Holder();
  };
  inline static const std::shared_ptr<VarNode> kNoNode;  // the node of Var()
  std::shared_ptr<Holder> holder_;
};

}  // namespace pollen::ag
