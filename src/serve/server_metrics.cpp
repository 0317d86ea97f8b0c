#include "serve/server_metrics.h"

#include "obs/prometheus.h"

namespace pollen::serve {

void RequestCounts::count(std::string_view path, bool known_path, int status, double seconds) {
  const std::string key = known_path ? std::string(path) : std::string("other");
  std::lock_guard lock(mu_);
  ++answered_[{key, status}];
  if (seconds >= 0) durations_[key].observe(seconds);
}

std::map<std::pair<std::string, int>, int64_t> RequestCounts::answered() const {
  std::lock_guard lock(mu_);
  return answered_;
}

std::map<std::string, obs::SecondsHistogram> RequestCounts::durations() const {
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
    p.histogram(obs::SecondsHistogram::bounds(), durations.counts, durations.sum, {{"path", path}});
  p.family("pollen_serve_time_to_first_token_seconds", "histogram",
           "Seconds from a request's submission to the engine to its first generated token.");
  p.histogram(obs::SecondsHistogram::bounds(), st.first_token.counts, st.first_token.sum);
  p.gauge("pollen_serve_requests_in_flight", "API requests being answered now.", d(st.in_flight));
  p.gauge("pollen_serve_requests_waiting", "Requests waiting for rows in the engine's batch.",
          d(st.waiting));
  p.counter("pollen_serve_generated_tokens_total", "Tokens generated.", d(st.tokens_generated));
  p.gauge("pollen_serve_largest_batch", "Most requests generating at once so far.",
          d(st.largest_batch));
  return p.text();
}

}  // namespace pollen::serve
