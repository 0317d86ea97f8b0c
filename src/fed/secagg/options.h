#pragma once
// The [secure_aggregation] table of the server's config (docs/federated.md): whether the round's
// updates are securely aggregated, the Shamir threshold, SecAgg+'s neighbour count, and how
// pseudo-gradients are quantised into the ring Z_(2^ring_bits) before masking.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace pollen {
class ConfigTable;
}

namespace pollen::fed::secagg {

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
  bool stochastic = true;         // stochastic rounding (unbiased, |err| < step), else nearest
  double phase_timeout_s = 60;    // key, share and unmask phases close then with who answered

  // Throws naming the key (where(key) says where it was read) when a value is out of range.
  void validate(const std::function<std::string(const std::string&)>& where) const;
  // The largest |quantised value| of one coordinate: ceil(range / step).
  int64_t max_level() const;
  // The rounding's bound on |dequantised - true| per coordinate of the mean (no clipping).
  double error_bound() const { return stochastic ? step : step / 2; }
  // The threshold for secrets with `holders` holders (a client's neighbours and itself).
  size_t resolved_threshold(size_t holders) const;
};

// Reads [secure_aggregation]; every key is optional (enabled defaults to false).
Options read_options(ConfigTable& table);

}  // namespace pollen::fed::secagg
