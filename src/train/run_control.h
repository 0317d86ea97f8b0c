#pragma once
// What every training loop of pollen shares around its steps (pre-training's and
// post-training's): stopping on SIGINT/SIGTERM after the current step, choosing the checkpoint to
// resume from, memory figures and JSON numbers for metrics.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

namespace pollen::train {

// Installs the stop handlers for the life of a run: the first SIGINT/SIGTERM asks the loop to
// finish its step, checkpoint and stop; the handlers are one-shot, so a second signal kills.
class SignalGuard {
 public:
  explicit SignalGuard(bool enable);
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  bool enabled_;
  struct Saved;
  Saved* saved_ = nullptr;
};

// Whether a stop signal arrived since the guard was installed.
bool stop_requested();

// The newest checkpoint under `root` that verifies (none: no dir), and how many were skipped
// with a warning each. When one is chosen, the newer ones that do not verify are moved aside
// (".corrupt-step-..."): the resumed run will never reach them again, and retention would
// otherwise count them as the newest and delete good checkpoints instead.
struct ResumePoint {
  std::optional<std::filesystem::path> dir;
  int64_t skipped = 0;
};
ResumePoint choose_checkpoint_to_resume(const std::filesystem::path& root);

double rss_mb();
double peak_rss_mb();

// JSON numbers for metrics: non-finite values become null (JSON has no NaN).
nlohmann::ordered_json json_number(double v);

}  // namespace pollen::train
