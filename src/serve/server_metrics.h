#pragma once
// What `pollen serve` reports on /metrics (Prometheus text format, obs/prometheus.h): requests by
// endpoint and status and how long they took, the time to a request's first token, requests in
// flight and waiting for the engine, tokens generated and the largest batch.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "obs/seconds_histogram.h"

namespace pollen::serve {

// Requests answered, by path and HTTP status, and their durations by path (a path that names no
// endpoint counts as "other", so that unknown URLs cannot grow the tables).
class RequestCounts {
 public:
  // `seconds` < 0: the duration is unknown (a request refused before routing).
  void count(std::string_view path, bool known_path, int status, double seconds);

  std::map<std::pair<std::string, int>, int64_t> answered() const;
  std::map<std::string, obs::SecondsHistogram> durations() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> answered_;
  std::map<std::string, obs::SecondsHistogram> durations_;
};

struct ServeStatus {
  std::map<std::pair<std::string, int>, int64_t> requests;  // (path, status) -> answered
  std::map<std::string, obs::SecondsHistogram> durations;   // path -> seconds to answer
  int64_t in_flight = 0;              // API requests being answered (those max_concurrent counts)
  int64_t waiting = 0;                // requests queued for the engine's next batch
  int64_t tokens_generated = 0;       // over every request so far
  int64_t largest_batch = 0;          // most requests that shared one batch
  obs::SecondsHistogram first_token;  // from a request's submission to its first generated token
};

std::string prometheus_metrics(const ServeStatus& status);

}  // namespace pollen::serve
