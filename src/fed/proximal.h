#pragma once
// FedProx's proximal term (Li et al. 2020), `train.proximal_mu` of a client: each local step
// minimises the loss plus mu / 2 |w - w_start|^2, w_start the weights the round's training
// started from, so that a silo's steps stay near the global model however far its data would
// take them. Its gradient, mu (w - w_start), is where the step's gradients start: backward then
// adds the loss's, and clipping and AdamW see the sum, as when the term is part of the loss.
#include <vector>

#include "autograd/var.h"
#include "fed/strategy.h"

namespace pollen::fed {

// Sets each parameter's gradient to scale (w - anchor), replacing what it held: `weights` the
// parameters' float32 weights (their values, or the master weights of bf16 copies), anchor[i]
// shaped as them and on their device; the gradient takes the parameter's dtype. With several
// ranks each seeds its share, scale = mu / ranks, and the gradient reduction sums the shares.
void seed_proximal_gradients(std::vector<ag::Var>& params, const std::vector<Tensor>& weights,
                             const Weights& anchor, double scale);

}  // namespace pollen::fed
