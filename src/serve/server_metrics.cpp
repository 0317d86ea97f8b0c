#include "serve/server_metrics.h"

#include "obs/prometheus.h"

namespace pollen::serve {

void RequestCounts::count(std::string_view path, bool known_path, int status) {
  std::lock_guard lock(mu_);
  ++counts_[{known_path ? std::string(path) : std::string("other"), status}];
}

std::map<std::pair<std::string, int>, int64_t> RequestCounts::snapshot() const {
  std::lock_guard lock(mu_);
  return counts_;
}

std::string prometheus_metrics(const ServeStatus& st) {
  obs::PrometheusText p;
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  p.family("pollen_serve_requests_total", "counter", "Requests answered, by path and status.");
  for (const auto& [key, n] : st.requests)
    p.sample(d(n), {{"path", key.first}, {"code", std::to_string(key.second)}});
  p.gauge("pollen_serve_requests_in_flight", "API requests being answered now.", d(st.in_flight));
  p.gauge("pollen_serve_requests_waiting", "Requests waiting for the engine's next batch.",
          d(st.waiting));
  p.counter("pollen_serve_generated_tokens_total", "Tokens generated.", d(st.tokens_generated));
  p.gauge("pollen_serve_largest_batch", "Most requests that shared one batch so far.",
          d(st.largest_batch));
  return p.text();
}

}  // namespace pollen::serve
