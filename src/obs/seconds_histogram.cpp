#include "obs/seconds_histogram.h"

#include <algorithm>

namespace pollen::obs {

const std::vector<double>& SecondsHistogram::bounds() {
  static const std::vector<double> b = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                        1,     2.5,  5,     10,   30,  60,   120};
  return b;
}

void SecondsHistogram::observe(double seconds) {
  // The first bucket whose upper bound the duration does not pass.
  const auto& b = bounds();
  ++counts[static_cast<size_t>(std::lower_bound(b.begin(), b.end(), seconds) - b.begin())];
  sum += seconds;
}

}  // namespace pollen::obs
