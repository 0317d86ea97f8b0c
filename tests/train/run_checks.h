#pragma once
// What the training tests check runs with: a run without output or signal handlers, the error a
// call throws and the records of a run's metrics.jsonl.
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/errors.h"
#include "train/trainer.h"

namespace pollen::test_support {

using pollen::testing::error_of;

// `pollen train` on `c` in this process, quiet, leaving signals alone; stop_after >= 0 preempts
// the run after that many steps, as a signal would.
inline train::TrainResult train_quiet(const train::TrainConfig& c, bool resume = false,
                                      int64_t stop_after = -1) {
  train::TrainOptions o;
  o.resume = resume;
  o.stop_after = stop_after;
  o.quiet = true;
  o.handle_signals = false;
  return train::run_training(c, o);
}

// Every record of run/metrics.jsonl, in order.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace pollen::test_support
