#pragma once
// The [secure_aggregation] table of the server's config (docs/federated.md): whether the round's
// updates are securely aggregated, the Shamir threshold, SecAgg+'s neighbour count, and how
// pseudo-gradients are quantised into the ring Z_(2^ring_bits) before masking.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace pollen {
class ConfigTable;
}

namespace pollen::fed::secagg {

// Distributed DP ([privacy] together with secure aggregation; docs/federated.md): the server
// sets it each round in the roster. Each client clips its update to the L2 norm `clip`, scales
// it by its weight (1, or min(1, tokens / token_cap)), quantises it and adds its share of the
// noise, the discrete Gaussian of variance ceil((stddev / step)^2) per value
// (fed/secagg/private_quantize.h); the shares of the at least k clients in any sum the server
// unmasks add up to at least the central mechanism's (z clip)^2.
struct DistributedNoise {
  double clip = 0;        // 0: off
  double stddev = 0;      // z clip / sqrt(k)
  int64_t token_cap = 0;  // 0: every client's weight is 1
  int64_t seed = -1;      // -1: the OS's CSPRNG; else repeatable noise for tests (no privacy)
  // Adaptive clipping: the noise share of the unclipped count, which the client sends as one
  // more masked value after the update ([norm <= clip] - 1/2); 0: the clip is fixed.
  double count_stddev = 0;
  // The noise is drawn truncated at this many standard deviations, which bounds every value a
  // client may send (a draw beyond it has probability below 1e-88).
  static constexpr double kTails = 20;

  bool enabled() const { return clip > 0; }
  bool counts_unclipped() const { return count_stddev > 0; }
  double largest_stddev() const { return std::max(stddev, count_stddev); }
};

struct Options {
  bool enabled = false;
  // Shares of a client's secrets needed to rebuild them; 0: a majority of its holders
  // (floor(holders / 2) + 1). Holders are its neighbours and itself. At least 2.
  int64_t threshold = 0;
  // k, the neighbours each client masks with (SecAgg+); 0: every other client (SecAgg).
  int64_t neighbours = 0;
  int ring_bits = 64;             // 32 or 64: the masked words, 4 or 8 bytes per value
  double range = 1.0;             // each pseudo-gradient value is clipped to [-range, range]
  double step = 1.0 / (1 << 24);  // quantisation step
  bool stochastic = true;       // stochastic rounding (|err| < step; unbiased, but for distributed
                                // DP's norm bound, which draws a rare rounding again), else nearest
  double phase_timeout_s = 60;  // key, share and unmask phases close then with who answered
  DistributedNoise noise;       // the round's, from [privacy]; not a key of this table

  // Throws naming the key (where(key) says where it was read) when a value is out of range.
  void validate(const std::function<std::string(const std::string&)>& where) const;
  // The discrete Gaussian's variance, in steps^2, of noise of std `stddev`:
  // ceil((stddev / step)^2), 0 for none. Throws past optim::kMaxDiscreteVariance, naming the keys.
  uint64_t noise_variance(double stddev) const;
  // The largest |noise| a client adds to a value, in steps: floor(kTails sqrt(variance)).
  int64_t noise_tail(double stddev) const;
  // The largest |quantised value| of a coordinate that carries noise of `stddev`:
  // ceil(range / step) + noise_tail(stddev).
  int64_t level(double stddev) const;
  // The largest of any coordinate, the update's or the count's: what the ring must hold.
  int64_t max_level() const { return level(noise.largest_stddev()); }
  // The rounding's bound on |dequantised - true| per coordinate of the mean (no clipping).
  double error_bound() const { return stochastic ? step : step / 2; }
  // The threshold for secrets with `holders` holders (a client's neighbours and itself).
  size_t resolved_threshold(size_t holders) const;
};

// Reads [secure_aggregation]; every key is optional (enabled defaults to false).
Options read_options(ConfigTable& table);

}  // namespace pollen::fed::secagg
