#include "fed/secagg/private_quantize.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "base/thread_pool.h"
#include "optim/discrete_gaussian.h"
#include "optim/privacy_accountant.h"

namespace pollen::fed::secagg {

namespace {

// sqrt(2 ln(1 / beta)) for the rounding's failure probability beta = exp(-8).
constexpr double kRoundingSlack = 4;
// Values whose noise one generator draws: a block is one thread's work.
constexpr int64_t kNoiseBlock = 4096;

// One part of a release: integer vectors of `dim` values that neighbours move by l2 (and by
// min(l2^2, sqrt(dim) l2) in L1 norm), noised with shares of `central_stddev` over sqrt(k) for
// a k of at most `selected`.
std::vector<double> part_rdp(const Options& options, double l2, int64_t dim, double central_stddev,
                             int64_t selected) {
  const double l1 = std::min(l2 * l2, std::sqrt(static_cast<double>(dim)) * l2);
  const double levels = central_stddev / options.step;
  // The smallest share is that of the largest k: n shares of variance ceil(levels^2 / k) with
  // n >= k add up to at least levels^2.
  const auto share =
      static_cast<double>(options.noise_variance(central_stddev / std::sqrt(selected)));
  return optim::distributed_discrete_gaussian_rdp(l2, l1, dim, levels * levels, share, selected);
}

}  // namespace

double rounded_norm_bound(double norm, int64_t dim, const Options& options) {
  const double c = norm / options.step;
  const double root_d = std::sqrt(static_cast<double>(dim));
  if (!options.stochastic) return c + root_d / 2;
  const double conditioned = c * c + root_d * root_d / 4 + kRoundingSlack * (c + root_d / 2);
  return std::sqrt(std::min(conditioned, (c + root_d) * (c + root_d)));
}

std::vector<uint64_t> quantize_private(const Weights& values, double norm, double stddev,
                                       const Options& options, uint64_t rounding_seed,
                                       const Rng& noise, QuantizeStats* stats) {
  int64_t dim = 0, clipped = 0;
  for (const Tensor& t : values) {
    const Tensor c = t.contiguous();
    const float* v = c.data<float>();
    for (int64_t j = 0; j < c.numel(); ++j) {
      POLLEN_CHECK(std::isfinite(v[j]), "secure aggregation: non-finite pseudo-gradient value");
      if (std::fabs(v[j]) > options.range) ++clipped;
    }
    dim += c.numel();
  }
  // The rounded norm^2 is an integer, summed exactly and held to an integer n <= D2^2 exactly
  // (the largest below 2^53): D2^2 rounded down, stepped down while its floating-point square
  // rounded up past it (fma's sign is exact). Equality passes: rounding to nearest reaches D2
  // whenever c is a half-integer.
  using u128 = optim::DiscreteU128;
  const double bound = rounded_norm_bound(norm, dim, options);
  double bound_sq = std::floor(bound * bound);
  // Past 2^53 one unit is below a double's spacing: step down to the next double instead.
  while (std::fma(bound, bound, -bound_sq) < 0)
    bound_sq = bound_sq < 0x1p53 ? bound_sq - 1 : std::nextafter(bound_sq, 0.0);
  POLLEN_CHECK(bound_sq < 0x1p126, "secure aggregation: the clip ", norm, " is ",
               norm / options.step, " steps of ", options.step,
               ", more than the rounding's norm check holds; raise secure_aggregation.step or "
               "lower privacy.clip");
  const auto most = static_cast<u128>(bound_sq);
  // Each value's level, two's complement in the ring word before the noise and the mask.
  std::vector<uint64_t> out(static_cast<size_t>(dim));
  Rng rounding(rounding_seed);
  for (int attempt = 1;; ++attempt) {
    u128 norm_sq = 0;
    size_t k = 0;
    for (const Tensor& t : values) {
      const Tensor c = t.contiguous();
      const float* v = c.data<float>();
      for (int64_t j = 0; j < c.numel(); ++j, ++k) {
        const double x = std::clamp(static_cast<double>(v[j]), -options.range, options.range);
        const int64_t q = round_to_level(x / options.step, options.stochastic, rounding);
        out[k] = static_cast<uint64_t>(q);
        const auto magnitude = static_cast<u128>(q < 0 ? -q : q);  // at most 2^52
        norm_sq += magnitude * magnitude;
        if (norm_sq > most) break;  // no overflow: each term is below 2^105
      }
      if (norm_sq > most) break;
    }
    if (norm_sq <= most) break;
    // Each draw passes with probability above 1 - exp(-8) for an update of norm within `norm`.
    POLLEN_CHECK(attempt < 64, "secure aggregation: 64 roundings of an update clipped to ", norm,
                 " all exceeded the bound ", bound * options.step, " on its rounded norm");
  }
  const uint64_t variance = options.noise_variance(stddev);
  const int64_t tail = options.noise_tail(stddev);
  if (variance > 0) {
    // Block b's draws come from noise.fork(b), on whichever thread: the same for any split.
    const int64_t blocks = (dim + kNoiseBlock - 1) / kNoiseBlock;
    parallel_for(blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        Rng draws = noise.fork(static_cast<uint64_t>(b));
        for (int64_t j = b * kNoiseBlock; j < std::min(dim, (b + 1) * kNoiseBlock); ++j) {
          int64_t e = 0;
          do {
            e = optim::discrete_gaussian(draws, variance);
          } while (e > tail || e < -tail);
          out[static_cast<size_t>(j)] += static_cast<uint64_t>(e);  // mod 2^64
        }
      }
    });
  }
  const uint64_t mask = ring_mask(options.ring_bits);
  for (uint64_t& w : out) w &= mask;
  if (stats) stats->clipped = clipped;
  return out;
}

std::vector<double> release_rdp(const Options& options, const DistributedNoise& central,
                                int64_t dim, int64_t selected) {
  POLLEN_CHECK(central.enabled() && dim >= 1 && selected >= 1,
               "distributed DP: a release needs a clip, values and clients");
  // No noise: no privacy.
  if (central.stddev == 0) return std::vector<double>(optim::rdp_orders().size(), INFINITY);
  std::vector<double> rdp = part_rdp(options, rounded_norm_bound(central.clip, dim, options), dim,
                                     central.stddev, selected);
  if (central.counts_unclipped()) {
    const double l2 = 2 * rounded_norm_bound(0.5, 1, options);
    const std::vector<double> count = part_rdp(options, l2, 1, central.count_stddev, selected);
    for (size_t k = 0; k < rdp.size(); ++k) rdp[k] += count[k];
  }
  return rdp;
}

}  // namespace pollen::fed::secagg
