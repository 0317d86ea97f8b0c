#include "obs/prometheus.h"

#include <charconv>
#include <cmath>

#include "base/error.h"

namespace pollen::obs {
namespace {

bool valid_name(std::string_view name, bool colon_allowed) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon_allowed && c == ':');
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// HELP escapes \ and newline; label values also ".
std::string escape(std::string_view s, bool quote) {
  std::string out;
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string prometheus_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

PrometheusText& PrometheusText::family(std::string_view name, std::string_view type,
                                       std::string_view help) {
  POLLEN_CHECK(valid_name(name, true), "prometheus: invalid metric name '", name, "'");
  POLLEN_CHECK(type == "counter" || type == "gauge" || type == "untyped" || type == "histogram",
               "prometheus: metric '", name, "' has type '", type,
               "'; expected counter, gauge, untyped or histogram");
  // OpenMetrics keeps the _total suffix for counters (its parsers refuse it on anything else).
  POLLEN_CHECK(type == "counter" || !name.ends_with("_total"), "prometheus: metric '", name,
               "' ends in _total, which only counters may");
  name_ = name;
  histogram_ = type == "histogram";
  text_ += cat("# HELP ", name, " ", escape(help, false), "\n# TYPE ", name, " ", type, "\n");
  return *this;
}

PrometheusText& PrometheusText::sample(double value, const Labels& labels) {
  POLLEN_CHECK(!name_.empty(), "prometheus: a sample before any metric family");
  POLLEN_CHECK(!histogram_, "prometheus: histogram '", name_, "' takes histogram(), not sample()");
  write_sample(name_, value, labels);
  return *this;
}

PrometheusText& PrometheusText::histogram(const std::vector<double>& upper_bounds,
                                          const std::vector<int64_t>& counts, double sum,
                                          const Labels& labels) {
  POLLEN_CHECK(histogram_, "prometheus: histogram() outside a histogram family");
  POLLEN_CHECK(counts.size() == upper_bounds.size() + 1, "prometheus: histogram '", name_, "' has ",
               counts.size(), " bucket counts for ", upper_bounds.size(),
               " bounds (one more for +Inf expected)");
  for (const auto& [k, v] : labels)
    POLLEN_CHECK(k != "le", "prometheus: histogram '", name_, "' may not have a label 'le'");
  int64_t below = 0;  // cumulative: the samples at or under each bound
  for (size_t b = 0; b <= upper_bounds.size(); ++b) {
    below += counts[b];
    Labels with_le = labels;
    with_le.emplace_back(
        "le", b < upper_bounds.size() ? prometheus_value(upper_bounds[b]) : std::string("+Inf"));
    write_sample(name_ + "_bucket", static_cast<double>(below), with_le);
  }
  write_sample(name_ + "_sum", sum, labels);
  write_sample(name_ + "_count", static_cast<double>(below), labels);
  return *this;
}

void PrometheusText::write_sample(const std::string& name, double value, const Labels& labels) {
  text_ += name;
  if (!labels.empty()) {
    text_ += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      POLLEN_CHECK(valid_name(labels[i].first, false) && labels[i].first.rfind("__", 0) != 0,
                   "prometheus: invalid label name '", labels[i].first, "' of metric '", name_,
                   "'");
      if (i > 0) text_ += ',';
      text_ += cat(labels[i].first, "=\"", escape(labels[i].second, true), "\"");
    }
    text_ += '}';
  }
  text_ += cat(" ", prometheus_value(value), "\n");
}

PrometheusText& PrometheusText::gauge(std::string_view name, std::string_view help, double value) {
  return family(name, "gauge", help).sample(value);
}

PrometheusText& PrometheusText::counter(std::string_view name, std::string_view help,
                                        double value) {
  return family(name, "counter", help).sample(value);
}

}  // namespace pollen::obs
