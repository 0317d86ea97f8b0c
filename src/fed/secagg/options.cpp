#include "fed/secagg/options.h"

#include <cmath>

#include "base/config.h"
#include "base/error.h"
#include "optim/discrete_gaussian.h"

namespace pollen::fed::secagg {

void Options::validate(const std::function<std::string(const std::string&)>& where) const {
  POLLEN_CHECK(ring_bits == 32 || ring_bits == 64, where("ring_bits"), ": 32 or 64, got ",
               ring_bits);
  POLLEN_CHECK(threshold == 0 || threshold >= 2, where("threshold"),
               ": 0 (a majority) or at least 2, got ", threshold);
  POLLEN_CHECK(neighbours >= 0, where("neighbours"), ": 0 (every client) or more, got ",
               neighbours);
  // At most the bound every decoded pseudo-gradient value is held to (fed/wire.h).
  POLLEN_CHECK(std::isfinite(range) && range > 0 && range <= 1e6, where("range"),
               ": must be positive and at most 1e6");
  POLLEN_CHECK(std::isfinite(step) && step > 0 && step <= range, where("step"),
               ": must be positive and at most the range of a value (", range, "), got ", step);
  POLLEN_CHECK(range / step <= 0x1p52, where("step"), ": range / step must be at most 2^52 levels");
  POLLEN_CHECK(std::isfinite(noise.clip) && noise.clip >= 0, where("dp_clip"),
               ": must be 0 (no distributed DP) or positive, got ", noise.clip);
  POLLEN_CHECK(
      std::isfinite(noise.stddev) && noise.stddev >= 0 && (noise.enabled() || noise.stddev == 0),
      where("dp_noise_stddev"), ": must be 0 or positive, and 0 without dp_clip, got ",
      noise.stddev);
  POLLEN_CHECK(noise.token_cap >= 0, where("dp_token_cap"), ": must be 0 or positive, got ",
               noise.token_cap);
  const bool count_ok = std::isfinite(noise.count_stddev) && noise.count_stddev >= 0 &&
                        (noise.enabled() || noise.count_stddev == 0);
  POLLEN_CHECK(count_ok, where("dp_count_stddev"),
               ": must be 0 or positive, and 0 without dp_clip, got ", noise.count_stddev);
  POLLEN_CHECK(!noise.counts_unclipped() || range >= 0.5, where("range"),
               ": adaptive clipping sends each client's indicator +-1/2, so range must be at "
               "least 0.5, got ",
               range);
  // One client with one token must fit: the server checks the round's total tokens.
  const auto levels = static_cast<double>(max_level());
  const bool fits = levels < std::ldexp(1.0, ring_bits - 1);
  const char* tails = noise.largest_stddev() > 0 ? " and the noise's tails" : "";
  POLLEN_CHECK(fits, where("ring_bits"), ": ", levels, " levels (range", tails, " over step) ",
               "do not fit a ", ring_bits, "-bit ring; use ring_bits 64 or a coarser step");
  // Deadlines are taken as now + seconds: a steady clock's range bounds them.
  POLLEN_CHECK(std::isfinite(phase_timeout_s) && phase_timeout_s > 0 && phase_timeout_s <= 1e9,
               where("phase_timeout_s"),
               ": must be more than 0 and at most 1000000000 seconds, got ", phase_timeout_s);
}

uint64_t Options::noise_variance(double stddev) const {
  if (stddev == 0) return 0;
  const double variance = std::ceil((stddev / step) * (stddev / step));
  POLLEN_CHECK(variance <= static_cast<double>(optim::kMaxDiscreteVariance),
               "secure aggregation: distributed DP noise of std ", stddev, " is ",
               std::sqrt(variance), " steps of ", step,
               ", past the 2^28 steps the discrete Gaussian takes; raise secure_aggregation.step "
               "or lower privacy.clip or noise_multiplier");
  return static_cast<uint64_t>(std::max(1.0, variance));
}

int64_t Options::noise_tail(double stddev) const {
  const uint64_t variance = noise_variance(stddev);
  return static_cast<int64_t>(
      std::floor(DistributedNoise::kTails * std::sqrt(static_cast<double>(variance))));
}

int64_t Options::level(double stddev) const {
  // range / step is at most 2^52 (validate) and the tail at most 20 * 2^28.
  return static_cast<int64_t>(std::ceil(range / step)) + noise_tail(stddev);
}

size_t Options::resolved_threshold(size_t holders) const {
  return threshold > 0 ? static_cast<size_t>(threshold) : holders / 2 + 1;
}

Options read_options(ConfigTable& t) {
  Options o;
  o.enabled = t.get_bool("enabled", o.enabled);
  o.threshold = t.get_int("threshold", o.threshold);
  o.neighbours = t.get_int("neighbours", o.neighbours);
  o.ring_bits =
      static_cast<int>(t.get_int_in("ring_bits", o.ring_bits, 32, 64));  // validate(): 32 or 64
  o.range = t.get_double("range", o.range);
  o.step = t.get_double("step", o.step);
  const std::string rounding = t.get_string("rounding", "stochastic");
  POLLEN_CHECK(rounding == "stochastic" || rounding == "nearest", t.where("rounding"),
               ": 'stochastic' or 'nearest', got '", rounding, "'");
  o.stochastic = rounding == "stochastic";
  o.phase_timeout_s = t.get_double("phase_timeout_s", o.phase_timeout_s);
  t.finish();
  o.validate([&](const std::string& key) { return t.where(key); });
  return o;
}

}  // namespace pollen::fed::secagg
