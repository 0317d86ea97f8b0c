#pragma once
// From float pseudo-gradients to the ring Z_(2^b) that masks live in, and back.
//
// Client i with t_i tokens and pseudo-gradient delta_i (float32) sends, per coordinate,
//
//   q_i = round(clip(delta_i, -range, range) / step)      an integer, |q_i| <= L = ceil(range/step)
//   x_i = t_i * q_i  mod 2^b                               the token-weighted value, exact
//
// with stochastic rounding (floor or ceil with the probabilities that make E[q_i] = d / step,
// seeded per client and round) or rounding to nearest. The server unmasks S = sum_i x_i mod 2^b,
// reads it as a signed b-bit integer and returns Delta = step * S / sum_i t_i. As long as
// sum_i t_i * L < 2^(b-1) (checked before dequantising) nothing wraps, S is the exact integer
// sum, and per coordinate (values inside the range)
//
//   |Delta - sum_i t_i delta_i / sum_i t_i| <= step / 2 (nearest), < step (stochastic),
//
// since Delta's error is the token-weighted mean of the per-client rounding errors; plus one
// float32 rounding of the result.
//
// With distributed DP (Options::noise) each client's weight is 1, its value w_i clip_C(delta_i)
// is quantised and noised by fed/secagg/private_quantize.h, and the server divides by the
// round's fixed denominator m (the clients selected) instead of the weights' sum.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/rng.h"
#include "fed/secagg/options.h"
#include "fed/strategy.h"

namespace pollen::fed::secagg {

struct QuantizeStats {
  int64_t clipped = 0;  // values outside [-range, range]
};

// x_i for every coordinate of `delta` (tensors concatenated in order), weighted by `weight`
// (t_i). `seed` drives the stochastic rounding.
std::vector<uint64_t> quantize(const Weights& delta, int64_t weight, const Options& options,
                               uint64_t seed, QuantizeStats* stats = nullptr);

// `scaled` (a value over step) rounded to an integer: floor or ceil with the probabilities that
// make the result unbiased (`stochastic`, drawing from `rng`), else to nearest.
int64_t round_to_level(double scaled, bool stochastic, Rng& rng);

// Throws (saying what to change) when sum_i t_i * L could wrap the ring.
void check_fits(int64_t total_weight, const Options& options);

// Distributed DP, before a round: throws (naming keys through `where`) when `selected` clients'
// values with noise shares as large as `largest_share` (each client's at threshold 2) could not
// be drawn or could wrap the ring.
void check_noise_fits(Options options, const DistributedNoise& largest_share, int64_t selected,
                      const std::function<std::string(const std::string&)>& where);

// step * S / denominator from the unmasked sum S of values weighted `total_weight` in all
// (sum_i t_i, or the clients in the sum), shaped like `like`. The denominator is total_weight
// for the token-weighted mean, the clients selected with distributed DP. With adaptive clipping
// the last tensor of `like` is the count (secagg::kUnclippedCount), held to its own noise's
// bound.
Weights dequantize(const std::vector<uint64_t>& sum, int64_t total_weight, double denominator,
                   const Options& options, const Weights& like);

// The signed value of a b-bit ring word.
int64_t ring_signed(uint64_t word, int ring_bits);
uint64_t ring_mask(int ring_bits);

}  // namespace pollen::fed::secagg
