#pragma once
// A Prometheus scrape endpoint: GET /metrics answers what `render` returns (text exposition
// format 0.0.4, obs/prometheus.h), from a background thread of cpp-httplib; other paths get 404.
// The server stops when the endpoint is destroyed.
#include <functional>
#include <memory>
#include <string>

namespace pollen::obs {

class MetricsEndpoint {
 public:
  // Listens on `address` ("host:port"; port 0 picks a free one). Throws when the address is
  // malformed or cannot be bound.
  MetricsEndpoint(const std::string& address, std::function<std::string()> render);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pollen::obs
