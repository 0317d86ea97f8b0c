#include "autograd/lora.h"

#include "ops/elementwise.h"
#include "ops/gemm.h"

namespace pollen::ag {
namespace {

Var recorded_output(Tensor value, bool record) {
  Var out(std::move(value), record);
  out.node()->is_leaf = false;
  return out;
}

}  // namespace

Var lora_linear(const Var& x, const Var& w, const Var* bias, const Var& a, const Var& b,
                double scale, const Tensor& mask) {
  const int64_t m = w.size(0), k = w.size(1), r = a.size(0);
  POLLEN_CHECK(a.size(1) == k && b.size(0) == m && b.size(1) == r, "lora_linear: A ",
               shape_str(a.shape()), " and B ", shape_str(b.shape()), " do not adapt W ",
               shape_str(w.shape()));
  const Tensor x2 = x.value().reshape({-1, k});
  const int64_t n = x2.size(0);
  Tensor xd = x2;  // the adapter's input, (N,K)
  if (mask.defined()) {
    xd = Tensor::empty({n, k}, x2.dtype());
    ops::mul(x2.contiguous(), mask.reshape({n, k}), xd);
  }
  Tensor u = Tensor::empty({n, r}, x2.dtype());  // (N,r) = xd A^T
  ops::gemm(xd, false, a.value(), true, u);
  Tensor out = Tensor::empty({n, m}, x2.dtype());  // (N,M) = x W^T + bias + scale u B^T
  if (bias) {
    for (int64_t i = 0; i < n; ++i) out.slice(0, i, i + 1).copy_(bias->value().reshape({1, m}));
    ops::gemm(x2, false, w.value(), true, out, 1.0, 1.0);
  } else {
    ops::gemm(x2, false, w.value(), true, out);
  }
  ops::gemm(u, false, b.value(), true, out, scale, 1.0);

  const bool record = should_record({&x, &w, bias, &a, &b});
  Var y = recorded_output(out, record);
  if (!record) return y;
  active_tape()->record([yn = y.node(), xn = x.node(), wn = w.node(),
                         bn = bias ? bias->node() : std::shared_ptr<VarNode>(), an = a.node(),
                         b_n = b.node(), w_value = w.value(), a_value = a.value(),
                         b_value = b.value(), x2, xd, u, mask, scale, n, m, k, r]() {
    if (!yn->grad.defined()) return;
    const Tensor dy = yn->grad.contiguous().view({n, m});
    if (b_n->requires_grad) ops::gemm(dy, true, u, false, grad_buffer(b_n), scale, 1.0);
    Tensor du;  // (N,r) = scale dy B
    if (an->requires_grad || xn->requires_grad) {
      du = Tensor::empty({n, r}, dy.dtype());
      ops::gemm(dy, false, b_value, false, du, scale);
    }
    if (an->requires_grad) ops::gemm(du, true, xd, false, grad_buffer(an), 1.0, 1.0);
    if (wn->requires_grad) ops::gemm(dy, true, x2, false, grad_buffer(wn), 1.0, 1.0);
    if (bn && bn->requires_grad) {  // column sums of dy, in row order
      Tensor ones = Tensor::full({1, n}, 1.0, dy.dtype());
      Tensor db = grad_buffer(bn).view({1, m});
      ops::gemm(ones, false, dy, false, db, 1.0, 1.0);
    }
    if (xn->requires_grad) {  // dx = dy W + (du A) * mask
      Tensor dx = Tensor::empty({n, k}, dy.dtype());
      if (mask.defined()) {
        ops::gemm(du, false, a_value, false, dx);
        ops::mul(dx, mask.reshape({n, k}), dx);
        ops::gemm(dy, false, w_value, false, dx, 1.0, 1.0);
      } else {
        ops::gemm(dy, false, w_value, false, dx);
        ops::gemm(du, false, a_value, false, dx, 1.0, 1.0);
      }
      accumulate(xn, dx.view(xn->shape()));
    }
    yn->grad = Tensor();
  });
  return y;
}

Var lora_weight(const Var& w, const Var& a, const Var& b, double scale) {
  const int64_t m = w.size(0), k = w.size(1);
  POLLEN_CHECK(a.size(1) == k && b.size(0) == m && b.size(1) == a.size(0), "lora_weight: A ",
               shape_str(a.shape()), " and B ", shape_str(b.shape()), " do not adapt W ",
               shape_str(w.shape()));
  Tensor out = w.value().clone();
  ops::gemm(b.value(), false, a.value(), false, out, scale, 1.0);
  const bool record = should_record({&w, &a, &b});
  Var y = recorded_output(out, record);
  if (!record) return y;
  active_tape()->record([yn = y.node(), wn = w.node(), an = a.node(), b_n = b.node(),
                         a_value = a.value(), b_value = b.value(), scale]() {
    if (!yn->grad.defined()) return;
    const Tensor& dy = yn->grad;  // (M,K)
    if (b_n->requires_grad) ops::gemm(dy, false, a_value, true, grad_buffer(b_n), scale, 1.0);
    if (an->requires_grad) ops::gemm(b_value, true, dy, false, grad_buffer(an), scale, 1.0);
    if (wn->requires_grad) accumulate(wn, dy.clone());
    yn->grad = Tensor();
  });
  return y;
}

}  // namespace pollen::ag
