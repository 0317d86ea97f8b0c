#pragma once
// Evaluation of every checkpoint of a training run (`pollen eval --run RUN_DIR`), written beside
// the run's metrics. Each checkpoint that verifies is loaded and scored with eval::perplexity
// (every token of the split scored once, as `pollen eval --model CHECKPOINT --data M` does) on
// the run's own validation data, or on other manifests; checkpoints already evaluated on the
// same data, split and row length are skipped unless asked. Results: RUN_DIR/eval.jsonl, one
// line per checkpoint and dataset ordered by step, and TensorBoard scalars
// eval/<dataset>/loss and eval/<dataset>/perplexity against the step.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace pollen::train {

struct RunEvalOptions {
  std::vector<std::string> manifests;  // empty: the run's data.validation_manifests
  std::string split;                   // empty: the run's data.validation_split
  int64_t seq = 0, batch = 0;          // 0: the run's train.seq and train.micro_batch
  bool again = false;                  // evaluate checkpoints already in eval.jsonl again
  bool quiet = false;                  // no log line per result
};

struct RunEvalResult {
  std::vector<nlohmann::ordered_json> evaluated;  // the records written by this call
  int64_t already = 0;                            // (checkpoint, dataset) pairs skipped as done
  std::vector<std::pair<std::filesystem::path, std::string>> unverified;  // skipped, and why
};

RunEvalResult evaluate_run(const std::filesystem::path& run_dir, const RunEvalOptions& options);

// The records of RUN_DIR/eval.jsonl (none when it does not exist).
std::vector<nlohmann::ordered_json> read_run_evals(const std::filesystem::path& run_dir);

}  // namespace pollen::train
