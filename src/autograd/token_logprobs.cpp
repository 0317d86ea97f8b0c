#include "autograd/token_logprobs.h"

#include "ops/check.h"
#include "ops/token_logprobs.h"

namespace pollen::ag {

Var token_logprobs(const Var& h, const Var& w, const Tensor& targets, double temperature) {
  const int64_t c = w.size(1);
  const Tensor h2 = h.value().reshape({-1, c});
  Tensor tg = targets.reshape({-1});
  if (tg.device() != h2.device()) tg = tg.to(h2.device());  // a GPU model's targets move over
  const int64_t n = tg.numel();
  // logp and lse in the statistics dtype: f32 on the GPU, also for a bf16 model.
  const DType stats = ops::statistics_dtype(h2);
  const Device dev = h2.device();
  Tensor logp = Tensor::empty({n}, stats, dev), lse = Tensor::empty({n}, stats, dev);
  ops::token_logprobs_forward(h2, w.value(), tg, logp, lse, temperature);
  const bool record = should_record({&h, &w});
  Var y(logp, record);
  y.node()->is_leaf = false;
  if (!record) return y;
  active_tape()->record([out = y.node(), hn = h.node(), wn = w.node(), h2, w_value = w.value(), tg,
                         lse, temperature]() mutable {
    if (!out->grad.defined()) return;
    Tensor dh = Tensor::empty(h2.shape(), h2.dtype(), h2.device());
    // A frozen head (LoRA without an lm_head adapter) needs no dw: its GEMM is skipped.
    Tensor dw;
    if (wn->requires_grad) dw = Tensor::zeros(w_value.shape(), w_value.dtype(), h2.device());
    ops::token_logprobs_backward(out->grad, h2, w_value, tg, lse, dh, dw, temperature);
    if (hn->requires_grad) accumulate(hn, dh.view(hn->shape()));
    if (wn->requires_grad) accumulate(wn, dw);
    out->grad = Tensor();
  });
  return y;
}

}  // namespace pollen::ag
