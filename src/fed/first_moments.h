#pragma once
// Shared first moments of the token rows (`strategy.first_moments`; docs/federated.md, "Shared
// first moments").
//
// Each client's inner AdamW moves every row of the output layer by its own running mean of the
// gradient, m: a client pushes up the rows of the tokens its silo writes and down every other
// one. The data-parallel baseline's m is the mean of all silos' gradients, in which one silo's
// push down on a row another silo writes is weighed against that silo's push up. With
// `first_moments = "output"` (or `"token_rows"`, the embedding too) the clients send AdamW's
// estimate m / (1 - beta1^t) of those tensors with their update, the server averages them by
// tokens, and every client starts the next round from that average, so that a round's first
// steps follow the federation's gradient on the rows before each client's own takes over.
//
// They travel beside the model's tensors, with the round's codecs but no error feedback (a
// moment is a state, not a sum over rounds): appended to the update's tensor set as
// "<tensor>.exp_avg", and pulled as a set of their own after the round's model.
#include <string>
#include <vector>

#include "fed/wire.h"

namespace pollen::fed {

// What `strategy.first_moments` may name, in the order a silo's order codes them: none, output,
// token_rows.
const std::vector<std::string>& first_moments_names();

// The tensors whose first moments are shared (`which`: one of first_moments_names()), named
// "<tensor>.exp_avg", in the specs' order. A tied embedding is the output layer.
ParamSpecs first_moment_specs(const ParamSpecs& specs, const std::string& which);

// The model tensor a moment spec belongs to ("lm_head.weight" of "lm_head.weight.exp_avg").
std::string moment_tensor_name(const ParamSpec& moment);

// The largest magnitude a shared first moment may have. AdamW's m is a running mean of
// gradients, which clipping keeps near 1; a client that sends more is refused, so that no
// client can push the average, or its encoding, out of float32's range.
constexpr float kMaxFirstMoment = 1e6f;

// Refuses moments that are not finite or larger than kMaxFirstMoment, naming `what`, the tensor
// and the index.
void check_first_moments(const ParamSpecs& moments, const Weights& m, const std::string& what);

// The weighted mean of the clients' moments, tensor by tensor, summed in double in the order
// given.
Weights average_first_moments(const std::vector<const Weights*>& each,
                              const std::vector<double>& weights);

}  // namespace pollen::fed
