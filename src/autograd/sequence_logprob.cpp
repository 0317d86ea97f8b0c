#include "autograd/sequence_logprob.h"

#include "base/error.h"
#include "ops/cross_entropy.h"

namespace pollen::ag {

Var sequence_logprobs(const Var& h, const Var& w, const Tensor& targets, int64_t rows) {
  const int64_t c = w.size(1);
  const Tensor h2 = h.value().reshape({-1, c});  // (B*T,C)
  const Tensor tg = targets.reshape({-1});       // (B*T)
  const int64_t n = h2.size(0);
  POLLEN_CHECK(rows > 0 && n % rows == 0, "sequence_logprobs: ", n, " positions do not split into ",
               rows, " rows");
  POLLEN_CHECK(tg.numel() == n, "sequence_logprobs: ", tg.numel(), " targets for ", n,
               " positions");
  const int64_t t = n / rows;

  // Forward: logp[b] = -(cross-entropy summed over row b's scored positions).
  Tensor logp = Tensor::empty({rows}, h.dtype());
  for (int64_t b = 0; b < rows; ++b) {
    int64_t scored = 0;
    const double ce = ops::cross_entropy_forward(h2.slice(0, b * t, (b + 1) * t), w.value(),
                                                 tg.slice(0, b * t, (b + 1) * t), &scored);
    logp.slice(0, b, b + 1).fill_(-ce);
  }

  const bool record = should_record({&h, &w});
  Var y(logp, record);
  y.node()->is_leaf = false;
  if (!record) return y;
  active_tape()->record(
      [out = y.node(), hn = h.node(), wn = w.node(), h2, w_value = w.value(), tg, rows, t, c]() {
        if (!out->grad.defined()) return;
        // Backward: row b's cross-entropy again with gradients, scaled by -dlogp[b]; dh (B*T,C),
        // dw (V,C) accumulated over rows.
        const std::vector<double> dlogp = out->grad.to_doubles();
        out->grad = Tensor();
        ops::CrossEntropyGrads grads;
        if (wn->requires_grad)  // a frozen head needs no dw (its GEMM is skipped)
          grads.dw = Tensor::zeros(w_value.shape(), w_value.dtype());
        Tensor dh = Tensor::zeros(h2.shape(), h2.dtype());
        for (int64_t b = 0; b < rows; ++b) {
          if (dlogp[static_cast<size_t>(b)] == 0) continue;
          grads.dh = dh.slice(0, b * t, (b + 1) * t);
          grads.grad_scale = -dlogp[static_cast<size_t>(b)];
          int64_t scored = 0;
          ops::cross_entropy_forward(h2.slice(0, b * t, (b + 1) * t), w_value,
                                     tg.slice(0, b * t, (b + 1) * t), &scored, &grads);
        }
        if (hn->requires_grad) accumulate(hn, dh.view(hn->shape()));
        if (wn->requires_grad) accumulate(wn, grads.dw);
      });
  return y;
}

}  // namespace pollen::ag
