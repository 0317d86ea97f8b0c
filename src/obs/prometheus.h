#pragma once
// Prometheus text exposition format 0.0.4 (what a Prometheus server scrapes from /metrics):
//
//   # HELP pollen_fed_round Rounds aggregated so far.
//   # TYPE pollen_fed_round gauge
//   pollen_fed_round 3
//   pollen_fed_client_train_loss{client="silo-a"} 4.25
//
// Metric and label names are checked ([a-zA-Z_:][a-zA-Z0-9_:]*, labels without ':'); HELP text
// escapes backslash and newline, label values also the double quote; NaN and infinities are
// written NaN, +Inf and -Inf.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pollen::obs {

// The content type a scrape response carries.
inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

using Labels = std::vector<std::pair<std::string, std::string>>;

class PrometheusText {
 public:
  // Starts a metric family: its HELP and TYPE lines. type: counter, gauge, untyped or
  // histogram.
  PrometheusText& family(std::string_view name, std::string_view type, std::string_view help);
  // One sample of the family started last (not a histogram).
  PrometheusText& sample(double value, const Labels& labels = {});
  // One series of the histogram family started last: `counts[b]` observations in bucket b, the
  // values above upper_bounds[b - 1] and at most upper_bounds[b] (the last bucket: above every
  // bound), written as the cumulative NAME_bucket{le=...} lines, NAME_sum and NAME_count.
  PrometheusText& histogram(const std::vector<double>& upper_bounds,
                            const std::vector<int64_t>& counts, double sum,
                            const Labels& labels = {});
  // Shorthands: a family with one unlabelled sample.
  PrometheusText& gauge(std::string_view name, std::string_view help, double value);
  PrometheusText& counter(std::string_view name, std::string_view help, double value);

  const std::string& text() const { return text_; }

 private:
  void write_sample(const std::string& name, double value, const Labels& labels);

  std::string text_, name_;
  bool histogram_ = false;  // the family started last is a histogram
};

// A sample value as the format writes it (shortest round-trip decimal, NaN, +Inf, -Inf).
std::string prometheus_value(double value);

}  // namespace pollen::obs
