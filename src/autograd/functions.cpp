#include "autograd/functions.h"

#include <cmath>
#include <memory>

#include "autograd/per_sample.h"
#include "ops/attention.h"
#include "ops/check.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/per_sample.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace pollen::ag {
namespace {
using NodePtr = std::shared_ptr<VarNode>;

Var make_output(Tensor value, bool record) {
  Var out(std::move(value), record);
  out.node()->is_leaf = false;
  return out;
}

// Records `fn(dout)` to run when out's gradient is known; out's gradient is released after.
template <typename F>
void on_backward(const Var& out, F&& fn) {
  active_tape()->record([out_node = out.node(), fn = std::forward<F>(fn)]() mutable {
    if (!out_node->grad.defined()) return;  // nothing flowed back through this output
    fn(out_node->grad);
    out_node->grad = Tensor();
  });
}

Tensor empty_like(const Tensor& t) {
  return Tensor::empty(t.shape(), t.dtype(), t.device());
}

// Ones on `device`, filled there: a host tensor copied over would wait for the GPU's queue.
Tensor ones(const Shape& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  t.fill_(1.0);
  return t;
}

// Per-sample clipping: a linear layer's dw (M,K) and db (M), written later from dy (N,M) with
// each sample's rows scaled.
void defer_linear_grads(PerSampleGradients& ps, const NodePtr& wn, const NodePtr& bn,
                        const Tensor& dy, const Tensor& x2) {
  const int64_t rows = ps.rows(), n = dy.size(0), m = dy.size(1);
  if (wn->requires_grad) {
    ps.defer(wn.get(), ops::sample_outer_norms_sq(dy, x2, rows),
             [wn, dy, x2, rows](const std::vector<double>& scale) {
               // dw (M,K) += (scaled dy)^T (M,N) @ x (N,K)
               ops::gemm(ops::scale_samples(dy, rows, scale), true,
                         ops::without_left_out(x2, rows, scale), false, grad_buffer(wn), 1.0, 1.0);
             });
  }
  if (bn && bn->requires_grad) {
    // A sample's db is its column sums of dy: dy^T @ ones (rows,1).
    ps.defer(bn.get(), ops::sample_outer_norms_sq(dy, ones({n, 1}, DType::f32, Device::cpu), rows),
             [bn, dy, rows, n, m](const std::vector<double>& scale) {
               Tensor db2 = grad_buffer(bn).view({1, m});
               ops::gemm(ones({1, n}, DType::f32, Device::cpu), false,
                         ops::scale_samples(dy, rows, scale), false, db2, 1.0, 1.0);
             });
  }
}

// Per-sample clipping: RMSNorm's dx now, and each sample's dw (C) kept to be summed scaled.
Tensor rmsnorm_per_sample(PerSampleGradients& ps, const NodePtr& wn, const Tensor& dy,
                          const Tensor& x2, const Tensor& w_value, const Tensor& rstd) {
  const int64_t rows = ps.rows(), c = x2.size(1), samples = ps.samples();
  POLLEN_CHECK(x2.size(0) == samples * rows, "per-sample clipping: rmsnorm over ", x2.size(0),
               " rows, not ", samples, " samples of ", rows);
  Tensor dx = empty_like(x2);
  Tensor dws = Tensor::zeros({samples, c}, DType::f32);
  std::vector<double> norms(static_cast<size_t>(samples));
  for (int64_t s = 0; s < samples; ++s) {
    const int64_t r0 = s * rows, r1 = r0 + rows;
    Tensor dx_s = dx.slice(0, r0, r1), dw_s = dws.slice(0, s, s + 1).view({c});
    ops::rmsnorm_backward(dy.slice(0, r0, r1), x2.slice(0, r0, r1), w_value, rstd.slice(0, r0, r1),
                          dx_s, dw_s, false);
    double& norm = norms[static_cast<size_t>(s)];
    for (int64_t j = 0; j < c; ++j)
      norm += static_cast<double>(dw_s.data<float>()[j]) * dw_s.data<float>()[j];
  }
  ps.defer(wn.get(), norms, [wn, dws, c](const std::vector<double>& scale) {
    Tensor& dw = grad_buffer(wn);
    for (size_t s = 0; s < scale.size(); ++s)
      if (scale[s] != 0)
        ops::axpy(scale[s],
                  dws.slice(0, static_cast<int64_t>(s), static_cast<int64_t>(s) + 1).view({c}), dw);
  });
  return dx;
}

}  // namespace

Var embedding(const Var& table, const Tensor& ids) {
  const int64_t n = ids.numel(), c = table.size(1);
  Tensor out = Tensor::empty({n, c}, table.dtype(), table.value().device());
  ops::embedding_forward(table.value(), ids.reshape({n}), out);
  const bool record = should_record({&table});
  Var y = make_output(out, record);
  if (record) {
    // On the GPU the tokens are grouped by id now, while the forward pass runs, not at the end of
    // the backward, where it would wait for the GPU.
    // Per-sample clipping: a head on the same table (tied embeddings) needs the ids.
    if (PerSampleGradients* ps = active_per_sample())
      ps->note_embedding_ids(table.node().get(), ids.reshape({n}));
    std::shared_ptr<const ops::EmbeddingRows> rows;
    if (table.value().device() == Device::cuda)
      rows = std::make_shared<const ops::EmbeddingRows>(
          ops::embedding_rows(ids.reshape({n}), table.size(0)));
    on_backward(y, [t = table.node(), ids = ids.reshape({n}), rows](const Tensor& dy) {
      if (PerSampleGradients* ps = active_per_sample()) {
        auto grads = std::make_shared<const std::vector<ops::SparseRows>>(
            ops::embedding_sample_grads(dy, ids, ps->rows()));
        std::vector<double> norms;
        for (const ops::SparseRows& g : *grads) norms.push_back(g.norm_sq());
        auto write = [t, grads](const std::vector<double>& scale) {
          ops::add_scaled_sparse_rows(*grads, scale, grad_buffer(t));
        };
        if (const std::optional<Tensor> tied = ps->take_tied_rows(t.get())) {
          // The table is the head too: |a + b|^2 = |a|^2 + |b|^2 + 2 <a, b>, the head's |b|^2
          // already counted.
          const std::vector<double> cross = ops::tied_cross_terms(*tied, dy, ps->rows());
          for (size_t s = 0; s < norms.size(); ++s) norms[s] += 2 * cross[s];
          ps->defer_tied(t.get(), norms, write);
        } else {
          ps->defer(t.get(), norms, write);
        }
        return;
      }
      ops::embedding_backward(dy, ids, grad_buffer(t), rows.get());
    });
  }
  return y;
}

Var linear(const Var& x, const Var& w, const Var* bias) {
  const int64_t k = w.size(1), m = w.size(0);
  const Tensor x2 = x.value().reshape({-1, k});
  const int64_t n = x2.size(0);
  const Device device = x2.device();
  Tensor out = Tensor::empty({n, m}, x.dtype(), device);
  if (bias) {
    // Start from the bias broadcast over rows (ones (N,1) @ bias (1,M), exact), then accumulate
    // x @ w^T.
    ops::gemm(ones({n, 1}, x.dtype(), device), false, bias->value().reshape({1, m}), false, out);
    ops::gemm(x2, false, w.value(), true, out, 1.0, 1.0);
  } else {
    ops::gemm(x2, false, w.value(), true, out);
  }
  const bool record = should_record({&x, &w, bias});
  Var y = make_output(out, record);
  if (record) {
    on_backward(y, [xn = x.node(), wn = w.node(), bn = bias ? bias->node() : NodePtr(), x2,
                    w_value = w.value(), n, m, k](const Tensor& dy) {
      if (xn->requires_grad) {  // dx (N,K) (+)= dy (N,M) @ w (M,K), accumulating in the GEMM
        if (xn->grad.defined()) {
          Tensor dx = xn->grad.view({n, k});
          ops::gemm(dy, false, w_value, false, dx, 1.0, 1.0);
        } else {
          Tensor dx = Tensor::empty({n, k}, dy.dtype(), dy.device());
          ops::gemm(dy, false, w_value, false, dx);
          accumulate(xn, dx);
        }
      }
      if (PerSampleGradients* ps = active_per_sample()) {
        defer_linear_grads(*ps, wn, bn, dy, x2);
        return;
      }
      if (wn->requires_grad) {  // dw (M,K) += dy^T (M,N) @ x (N,K)
        Tensor& dw = grad_buffer(wn);
        ops::gemm(dy, true, x2, false, dw, 1.0, 1.0);
      }
      if (bn && bn->requires_grad) {  // db (M) += column sums of dy, in row order
        Tensor& db = grad_buffer(bn);
        Tensor db2 = db.view({1, m});
        ops::gemm(ones({1, n}, dy.dtype(), dy.device()), false, dy, false, db2, 1.0, 1.0);
      }
    });
  }
  return y;
}

Var rmsnorm(const Var& x, const Var& w, double eps) {
  const int64_t c = w.size(0);
  const Tensor x2 = x.value().reshape({-1, c});
  Tensor y = empty_like(x2);
  Tensor rstd = Tensor::empty({x2.size(0)}, ops::statistics_dtype(x2), x2.device());
  ops::rmsnorm_forward(x2, w.value(), eps, y, rstd);
  const bool record = should_record({&x, &w});
  Var out = make_output(y.view(x.shape()), record);
  if (record) {
    on_backward(
        out, [xn = x.node(), wn = w.node(), x2, w_value = w.value(), rstd](const Tensor& dy) {
          PerSampleGradients* ps = active_per_sample();
          if (ps && wn->requires_grad) {
            accumulate(xn, rmsnorm_per_sample(*ps, wn, dy.reshape(x2.shape()), x2, w_value, rstd));
            return;
          }
          Tensor dx = empty_like(x2);
          Tensor dw_scratch;
          Tensor& dw = wn->requires_grad
                           ? grad_buffer(wn)
                           : (dw_scratch = Tensor::zeros(w_value.shape(), dy.dtype(), dy.device()));
          ops::rmsnorm_backward(dy.reshape(x2.shape()), x2, w_value, rstd, dx, dw, false);
          accumulate(xn, dx);
        });
  }
  return out;
}

Var rope(const Var& x, const Tensor& positions, const ops::RopeParams& params) {
  Tensor y = empty_like(x.value());
  ops::rope_forward(x.value(), positions, params, y);
  const bool record = should_record({&x});
  Var out = make_output(y, record);
  if (record) {
    on_backward(out, [xn = x.node(), positions, params](const Tensor& dy) {
      Tensor dx = empty_like(dy);
      ops::rope_backward(dy, positions, params, dx);
      accumulate(xn, dx);
    });
  }
  return out;
}

Var attention(const Var& q, const Var& k, const Var& v, const Tensor& seg_start, double scale) {
  const Tensor qc = q.value().contiguous(), kc = k.value().contiguous(),
               vc = v.value().contiguous();
  Tensor out = empty_like(qc);
  Tensor lse =
      Tensor::empty({qc.size(0), qc.size(2), qc.size(1)}, ops::statistics_dtype(qc), qc.device());
  ops::attention_forward(qc, kc, vc, seg_start, scale, out, lse);
  const bool record = should_record({&q, &k, &v});
  Var y = make_output(out, record);
  if (record) {
    on_backward(y, [qn = q.node(), kn = k.node(), vn = v.node(), qc, kc, vc, seg_start, out, lse,
                    scale](const Tensor& dy) {
      Tensor dq = empty_like(qc), dk = empty_like(kc), dv = empty_like(vc);
      ops::attention_backward(qc, kc, vc, seg_start, out, lse, dy.contiguous(), scale, dq, dk, dv);
      accumulate(qn, dq);
      accumulate(kn, dk);
      accumulate(vn, dv);
    });
  }
  return y;
}

Var swiglu(const Var& gate, const Var& up) {
  Tensor out = empty_like(gate.value());
  ops::swiglu_forward(gate.value(), up.value(), out);
  const bool record = should_record({&gate, &up});
  Var y = make_output(out, record);
  if (record) {
    on_backward(
        y, [gn = gate.node(), un = up.node(), g = gate.value(), u = up.value()](const Tensor& dy) {
          Tensor dg = empty_like(g), du = empty_like(u);
          ops::swiglu_backward(dy, g, u, dg, du);
          accumulate(gn, dg);
          accumulate(un, du);
        });
  }
  return y;
}

Var add(const Var& a, const Var& b) {
  Tensor out = empty_like(a.value());
  ops::add(a.value(), b.value(), out);
  const bool record = should_record({&a, &b});
  Var y = make_output(out, record);
  if (record) {
    on_backward(y, [an = a.node(), bn = b.node()](const Tensor& dy) {
      // The first input may take dy itself; the second gets its own copy so that later
      // accumulation into one never shows up in the other.
      if (an->requires_grad && bn->requires_grad) {
        accumulate(bn, dy.clone());
        accumulate(an, dy);
      } else {
        accumulate(an->requires_grad ? an : bn, dy);
      }
    });
  }
  return y;
}

Var reshape(const Var& x, const Shape& shape) {
  const bool record = should_record({&x});
  Var y = make_output(x.value().reshape(shape), record);
  if (record) {
    on_backward(y, [xn = x.node()](const Tensor& dy) { accumulate(xn, dy.reshape(xn->shape())); });
  }
  return y;
}

Var leading_rows(const Var& x, int64_t n) {
  POLLEN_CHECK(x.value().dim() >= 1 && n >= 0 && n <= x.size(0), "leading_rows: ", n,
               " rows of a tensor of ", x.value().dim() >= 1 ? x.size(0) : 0);
  const bool record = should_record({&x});
  Var y = make_output(x.value().slice(0, 0, n), record);
  if (record) {
    on_backward(y, [xn = x.node(), n](const Tensor& dy) {
      // (n, ...) into a zero gradient of x's shape: the rows past n are not used.
      Tensor dx = Tensor::zeros(xn->shape(), dy.dtype(), dy.device());
      dx.slice(0, 0, n).copy_(dy);
      accumulate(xn, dx);
    });
  }
  return y;
}

Var cross_entropy(const Var& h, const Var& w, const Tensor& targets, Reduction reduction,
                  int64_t* scored) {
  const int64_t c = w.size(1);
  const Tensor h2 = h.value().reshape({-1, c});
  const Tensor tg = targets.reshape({-1});
  const bool record = should_record({&h, &w});
  int64_t count = 0;
  double loss = 0;
  ops::CrossEntropyGrads grads;
  // Per-sample clipping: each sample's norm of the head's gradient now, from the logits' gradient
  // of this pass; dw itself later, in a second pass over the logits with each sample's scale.
  PerSampleGradients* ps = record && w.requires_grad() ? active_per_sample() : nullptr;
  auto head_norms = std::make_shared<std::vector<double>>();
  // Tied embeddings: the head's gradient of the table rows of the inputs' ids, for the cross term.
  Tensor input_ids;
  if (record) {
    // The gradient comes out of the same pass as the loss (for d loss = 1); backward scales it.
    grads.dh = empty_like(h2);
    // A frozen head (LoRA without an lm_head adapter) needs no dw: its GEMM is skipped.
    if (ps) {
      head_norms->assign(static_cast<size_t>(ps->samples()), 0.0);
      grads.sample_rows = ps->rows();
      grads.sample_norms_sq = head_norms.get();
      if (const Tensor* ids = ps->embedding_ids(w.node().get())) {
        POLLEN_CHECK(ids->dtype() == DType::i32 && ids->numel() == tg.numel(),
                     "per-sample clipping: the tied embedding saw ", ids->numel(),
                     " tokens, the head ", tg.numel());
        input_ids = ids->cpu().contiguous();
        grads.sample_input_ids = input_ids.data<int32_t>();
        grads.sample_tied_rows = Tensor::empty(h2.shape(), DType::f32);
      }
    } else if (w.requires_grad()) {
      grads.dw = Tensor::zeros(w.shape(), w.dtype(), w.value().device());
    }
    const Tensor host_targets = tg.cpu();
    int64_t n_scored = 0;
    for (int64_t i = 0; i < tg.numel(); ++i) n_scored += host_targets.data<int32_t>()[i] >= 0;
    grads.grad_scale = reduction == Reduction::mean && n_scored > 0 ? 1.0 / n_scored : 1.0;
    loss = ops::cross_entropy_forward(h2, w.value(), tg, &count, &grads);
  } else {
    loss = ops::cross_entropy_forward(h2, w.value(), tg, &count, nullptr);
  }
  if (scored) *scored = count;
  if (reduction == Reduction::mean) loss = count > 0 ? loss / static_cast<double>(count) : 0.0;
  // The loss is a host scalar in the statistics dtype: f32 for a bf16 model on the GPU.
  Var y = make_output(Tensor::full({1}, loss, ops::statistics_dtype(h.value())), record);
  if (record) {
    grads.sample_input_ids = nullptr;  // input_ids ends with this call
    on_backward(y, [hn = h.node(), wn = w.node(), grads, ps, head_norms, h2, tg,
                    w_value = w.value()](const Tensor& dy) mutable {
      const double s = dy.item();
      if (hn->requires_grad) {
        if (s != 1.0) ops::scale_into(s, grads.dh, grads.dh);
        accumulate(hn, grads.dh.view(hn->shape()));
      }
      if (ps) {
        POLLEN_CHECK(active_per_sample() == ps, "per-sample clipping: the cross-entropy's ",
                     "backward ran outside the pass that recorded it");
        for (double& v : *head_norms) v *= s * s;
        if (grads.sample_tied_rows.defined()) {
          if (s != 1.0) ops::scale_into(s, grads.sample_tied_rows, grads.sample_tied_rows);
          ps->note_tied_rows(wn.get(), grads.sample_tied_rows);
        }
        ps->defer(wn.get(), *head_norms,
                  [wn, h2, tg, w_value, grad_scale = s * grads.grad_scale,
                   rows = ps->rows()](const std::vector<double>& scale) {
                    ops::CrossEntropyGrads g;
                    g.dw = grad_buffer(wn);
                    g.grad_scale = grad_scale;
                    g.sample_rows = rows;
                    g.sample_scale = &scale;
                    int64_t rows_scored = 0;
                    ops::cross_entropy_forward(ops::without_left_out(h2, rows, scale), w_value, tg,
                                               &rows_scored, &g);
                  });
      } else if (wn->requires_grad) {
        if (wn->grad.defined()) {
          ops::axpy(s, grads.dw, wn->grad);
        } else {
          if (s != 1.0) ops::scale_into(s, grads.dw, grads.dw);
          accumulate(wn, grads.dw);
        }
      }
    });
  }
  return y;
}

Var checkpoint(const std::function<Var(const std::vector<Var>&)>& fn,
               const std::vector<Var>& inputs, const std::vector<Var>& captured) {
  Var out;
  {
    NoGrad no_grad;
    out = fn(inputs);
  }
  bool record = false;
  for (const Var& v : inputs) record = record || should_record({&v});
  for (const Var& v : captured) record = record || should_record({&v});
  Var y = make_output(out.value(), record);
  if (record) {
    on_backward(y, [fn, inputs](const Tensor& dy) {
      // Recompute with fresh leaves that share the inputs' values, then send their gradients on.
      std::vector<Var> leaves;
      for (const Var& v : inputs) leaves.emplace_back(v.value(), v.requires_grad());
      Tape inner;
      Var recomputed;
      {
        TapeScope scope(inner);
        recomputed = fn(leaves);
      }
      inner.backward(recomputed, dy);
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (leaves[i].grad().defined()) accumulate(inputs[i].node(), leaves[i].grad());
      }
    });
  }
  return y;
}

}  // namespace pollen::ag
