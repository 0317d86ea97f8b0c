#include "serve/server_metrics.h"

#include <algorithm>

#include "obs/prometheus.h"

namespace pollen::serve {

void RequestCounts::count(std::string_view path, bool known_path, int status, double seconds) {
  const std::string key = known_path ? std::string(path) : std::string("other");
  std::lock_guard lock(mu_);
  ++answered_[{key, status}];
  if (seconds < 0) return;
  const auto& bounds = request_seconds_bounds();
  // The first bucket whose upper bound the duration does not pass.
  const auto b =
      static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin());
  RequestDurations& d = durations_[key];
  ++d.counts[b];
  d.sum += seconds;
}

std::map<std::pair<std::string, int>, int64_t> RequestCounts::answered() const {
  std::lock_guard lock(mu_);
  return answered_;
}

std::map<std::string, RequestDurations> RequestCounts::durations() const {
  std::lock_guard lock(mu_);
  return durations_;
}

std::string prometheus_metrics(const ServeStatus& st) {
  obs::PrometheusText p;
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  p.family("pollen_serve_requests_total", "counter", "Requests answered, by path and status.");
  for (const auto& [key, n] : st.requests)
    p.sample(d(n), {{"path", key.first}, {"code", std::to_string(key.second)}});
  p.family("pollen_serve_request_seconds", "histogram",
           "Seconds from a request's arrival to its whole answer written (a stream's end).");
  for (const auto& [path, durations] : st.durations)
    p.histogram(request_seconds_bounds(), durations.counts, durations.sum, {{"path", path}});
  p.gauge("pollen_serve_requests_in_flight", "API requests being answered now.", d(st.in_flight));
  p.gauge("pollen_serve_requests_waiting", "Requests waiting for the engine's next batch.",
          d(st.waiting));
  p.counter("pollen_serve_generated_tokens_total", "Tokens generated.", d(st.tokens_generated));
  p.gauge("pollen_serve_largest_batch", "Most requests that shared one batch so far.",
          d(st.largest_batch));
  return p.text();
}

}  // namespace pollen::serve
