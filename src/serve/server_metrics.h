#pragma once
// What `pollen serve` reports on /metrics (Prometheus text format, obs/prometheus.h): requests by
// endpoint and status, requests in flight and waiting for the engine, tokens generated and the
// largest batch.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace pollen::serve {

// Requests answered, by path and HTTP status (a path that names no endpoint counts as "other",
// so that unknown URLs cannot grow the table).
class RequestCounts {
 public:
  void count(std::string_view path, bool known_path, int status);
  std::map<std::pair<std::string, int>, int64_t> snapshot() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> counts_;
};

struct ServeStatus {
  std::map<std::pair<std::string, int>, int64_t> requests;  // (path, status) -> answered
  int64_t in_flight = 0;         // API requests being answered (those max_concurrent counts)
  int64_t waiting = 0;           // requests queued for the engine's next batch
  int64_t tokens_generated = 0;  // over every request so far
  int64_t largest_batch = 0;     // most requests that shared one batch
};

std::string prometheus_metrics(const ServeStatus& status);

}  // namespace pollen::serve
