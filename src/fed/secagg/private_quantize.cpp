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
  std::vector<double> scaled;
  int64_t clipped = 0;
  for (const Tensor& t : values) {
    const Tensor c = t.contiguous();
    const float* v = c.data<float>();
    for (int64_t j = 0; j < c.numel(); ++j) {
      POLLEN_CHECK(std::isfinite(v[j]), "secure aggregation: non-finite pseudo-gradient value");
      double x = v[j];
      if (std::fabs(x) > options.range) {
        ++clipped;
        x = std::copysign(options.range, x);
      }
      scaled.push_back(x / options.step);
    }
  }
  const auto dim = static_cast<int64_t>(scaled.size());
  const double bound = rounded_norm_bound(norm, dim, options);
  std::vector<int64_t> levels(scaled.size());
  Rng rounding(rounding_seed);
  for (int attempt = 1;; ++attempt) {
    double norm_sq = 0;
    for (size_t j = 0; j < scaled.size(); ++j) {
      levels[j] = round_to_level(scaled[j], options.stochastic, rounding);
      norm_sq += static_cast<double>(levels[j]) * static_cast<double>(levels[j]);
    }
    if (norm_sq <= bound * bound) break;
    // Each draw passes with probability above 1 - exp(-8) for a norm within `norm`.
    POLLEN_CHECK(attempt < 64, "secure aggregation: 64 roundings of an update of norm ",
                 std::sqrt(norm_sq) * options.step, " all passed the bound ", bound * options.step,
                 " for the clip ", norm);
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
          levels[static_cast<size_t>(j)] += e;
        }
      }
    });
  }
  const uint64_t mask = ring_mask(options.ring_bits);
  std::vector<uint64_t> out;
  out.reserve(levels.size());
  for (int64_t q : levels) out.push_back(static_cast<uint64_t>(q) & mask);
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
