#pragma once
// Durations in seconds as a Prometheus histogram counts them (obs/prometheus.h): buckets with
// upper bounds from 5 ms to 120 s, a last one for the rest, and their sum.
#include <cstdint>
#include <vector>

namespace pollen::obs {

struct SecondsHistogram {
  static const std::vector<double>& bounds();
  void observe(double seconds);

  std::vector<int64_t> counts = std::vector<int64_t>(bounds().size() + 1, 0);  // per bucket
  double sum = 0;
};

}  // namespace pollen::obs
