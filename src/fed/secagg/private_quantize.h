#pragma once
// Distributed DP's quantisation: the distributed discrete Gaussian (Kairouz, Liu and Steinke 2021,
// "The distributed discrete Gaussian mechanism for federated learning with secure aggregation").
//
// A client's clipped and weighted update v (L2 norm at most c, the round's clip) becomes integers
// in units of secure_aggregation.step:
//   1. x = clip(v, -range, range) / step, per value (which only shrinks the norm);
//   2. q = x rounded per value (stochastic rounding, or to nearest), drawn again until
//      ||q||_2 <= D2, where, with c' = c / step and d values,
//        D2^2 = min(c'^2 + d/4 + sqrt(2 ln(1/beta)) (c' + sqrt(d)/2), (c' + sqrt(d))^2),
//      beta = exp(-8) (their Proposition 22: a draw passes with probability at least 1 - beta);
//      to nearest, D2 = c' + sqrt(d)/2, which every draw meets;
//   3. q + N_Z(0, sigma^2) per value, sigma^2 = ceil((stddev / step)^2), drawn exactly
//      (optim/discrete_gaussian.h) and truncated at Options::noise_tail by drawing again (a draw
//      beyond has probability below 1e-88);
//   4. mod 2^ring_bits.
// A zero update rounds to zero, so a client's real update against a zero one moves the integer
// sum by at most D2 in L2 norm and D1 = min(D2^2, sqrt(d) D2) in L1 norm, which release_rdp
// charges. The noise is added to integers: the sum the server unmasks is exactly the rounded
// updates plus discrete Gaussian draws, and no floating-point noise is released.
#include <cstdint>
#include <vector>

#include "base/rng.h"
#include "fed/secagg/options.h"
#include "fed/secagg/quantize.h"
#include "fed/strategy.h"

namespace pollen::fed::secagg {

// D2, in steps, for `dim` values of L2 norm at most `norm` (2. above).
double rounded_norm_bound(double norm, int64_t dim, const Options& options);

// The ring words of `values` (tensors concatenated in order; L2 norm at most `norm`), rounded
// within D2 from `rounding_seed` and noised with N_Z(0, sigma^2) for `stddev`: the values of
// block b (4096 values) from noise.fork(b), on the pool's threads.
std::vector<uint64_t> quantize_private(const Weights& values, double norm, double stddev,
                                       const Options& options, uint64_t rounding_seed,
                                       const Rng& noise, QuantizeStats* stats = nullptr);

// The RDP at each of optim::rdp_orders() of one round's unmasked sum of `dim` update values from
// at most `selected` clients, each share of the noise `central` over sqrt(k) for a threshold k
// of at most `selected`: `central` is the noise of the whole sum (CentralDp::distributed_noise
// with one input). The update's part, with sensitivity D2 of the clip, plus, with adaptive
// clipping, the count's, whose sensitivity is 2 D2 of 1/2 (a real update's indicator -1/2
// against a zero one's +1/2).
std::vector<double> release_rdp(const Options& options, const DistributedNoise& central,
                                int64_t dim, int64_t selected);

}  // namespace pollen::fed::secagg
