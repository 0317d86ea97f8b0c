#include "fed/secagg/quantize.h"

#include <cmath>

#include "base/error.h"
#include "base/rng.h"

namespace pollen::fed::secagg {

uint64_t ring_mask(int ring_bits) {
  return ring_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << ring_bits) - 1;
}

int64_t ring_signed(uint64_t word, int ring_bits) {
  if (ring_bits == 64) return static_cast<int64_t>(word);
  const uint64_t half = uint64_t{1} << (ring_bits - 1);
  return word >= half ? static_cast<int64_t>(word) - static_cast<int64_t>(half << 1)
                      : static_cast<int64_t>(word);
}

int64_t round_to_level(double scaled, bool stochastic, Rng& rng) {
  double q = std::floor(scaled);
  if (stochastic) {
    if (rng.uniform() < scaled - q) q += 1;
  } else if (scaled - q >= 0.5) {
    q += 1;
  }
  return static_cast<int64_t>(q);
}

std::vector<uint64_t> quantize(const Weights& delta, int64_t weight_in, const Options& options,
                               uint64_t seed, QuantizeStats* stats) {
  POLLEN_CHECK(weight_in >= 1, "secure aggregation: an update needs at least one token");
  check_fits(weight_in, options);
  int64_t n = 0;
  for (const Tensor& t : delta) n += t.numel();
  std::vector<uint64_t> out;
  out.reserve(static_cast<size_t>(n));
  const uint64_t mask = ring_mask(options.ring_bits);
  const auto weight = static_cast<uint64_t>(weight_in);
  Rng rng(seed);
  int64_t clipped = 0;
  for (const Tensor& t : delta) {
    const Tensor c = t.contiguous();
    const float* d = c.data<float>();
    for (int64_t j = 0; j < c.numel(); ++j) {
      POLLEN_CHECK(std::isfinite(d[j]), "secure aggregation: non-finite pseudo-gradient value");
      double v = d[j];
      if (std::fabs(v) > options.range) {
        ++clipped;
        v = std::copysign(options.range, v);
      }
      const int64_t q = round_to_level(v / options.step, options.stochastic, rng);
      // Two's complement product: t * q mod 2^b, exact for any sign.
      out.push_back((weight * static_cast<uint64_t>(q)) & mask);
    }
  }
  if (stats) stats->clipped = clipped;
  return out;
}

void check_fits(int64_t total_weight, const Options& options) {
  const double worst = static_cast<double>(total_weight) * static_cast<double>(options.max_level());
  POLLEN_CHECK(worst < std::ldexp(1.0, options.ring_bits - 1), "secure aggregation: ", total_weight,
               options.noise.enabled() ? " clients" : " tokens", " times ", options.max_level(),
               " levels (range", options.noise.stddev > 0 ? " and the noise's tails" : "",
               " over step) may wrap the ", options.ring_bits,
               "-bit ring; raise secure_aggregation.step, lower range, or use ring_bits 64");
}

void check_noise_fits(Options options, const DistributedNoise& largest_share, int64_t selected,
                      const std::function<std::string(const std::string&)>& where) {
  options.noise = largest_share;
  options.validate(where);
  check_fits(selected, options);
}

Weights dequantize(const std::vector<uint64_t>& sum, int64_t total_weight, double denominator,
                   const Options& options, const Weights& like) {
  check_fits(total_weight, options);
  POLLEN_CHECK(denominator > 0, "secure aggregation: the denominator must be positive, got ",
               denominator);
  const double scale = options.step / denominator;
  // Honest clients' values lie within +-range (plus their noise's truncated tails: the update's,
  // or the count's for the last tensor under adaptive clipping), so their weighted sum within
  // this: a sum past it holds a word no client may send (the masked updates are never checked
  // one by one).
  const auto weight = static_cast<double>(total_weight);
  Weights out;
  size_t k = 0;
  for (const Tensor& t : like) {
    const bool count = options.noise.counts_unclipped() && out.size() + 1 == like.size();
    const double stddev = count ? options.noise.count_stddev : options.noise.stddev;
    const double most = weight * static_cast<double>(options.level(stddev));
    Tensor d = Tensor::empty(t.shape(), DType::f32);
    float* o = d.data<float>();
    for (int64_t j = 0; j < d.numel(); ++j, ++k) {
      POLLEN_ASSERT(k < sum.size());
      const auto s = static_cast<double>(ring_signed(sum[k], options.ring_bits));
      POLLEN_CHECK(std::fabs(s) <= most, "secure aggregation: value ", k,
                   " of the unmasked sum is ", s * options.step, ", beyond what ", total_weight,
                   options.noise.enabled() ? " clients" : " tokens",
                   " of values within +-secure_aggregation.range (", options.range, ")",
                   stddev > 0 ? " and the noise's tails" : "",
                   " can add up to: a client sent a value outside it");
      o[j] = static_cast<float>(s * scale);
    }
    out.push_back(std::move(d));
  }
  POLLEN_ASSERT(k == sum.size());
  return out;
}

}  // namespace pollen::fed::secagg
