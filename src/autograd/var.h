#pragma once
// A Var is a tensor that autograd tracks: its value, its gradient (allocated on first use and
// accumulated across backward passes until zero_grad), and whether it wants one.
#include <memory>
#include <string>

#include "tensor/tensor.h"

namespace pollen::ag {

struct VarNode {
  Tensor value;
  Tensor grad;  // undefined until a backward pass reaches this Var
  bool requires_grad = false;
  bool is_leaf = true;  // made by the user (parameters, inputs); op outputs are not leaves
  std::string name;
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
  std::shared_ptr<VarNode> node_;
};

}  // namespace pollen::ag
