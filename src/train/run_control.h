#pragma once
// What every training loop of pollen shares around its steps (pre-training's and
// post-training's): stopping on SIGINT/SIGTERM after the current step, the run folder, choosing
// the checkpoint to resume from, the counters and metrics files a checkpoint continues, when to
// checkpoint, what a run that stops says, memory figures and JSON numbers for metrics.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "dist/communicator.h"
#include "obs/metrics.h"
#include "obs/progress.h"
#include "optim/schedule.h"

namespace pollen::dist {
class GradReducer;
}

namespace pollen::train {

// Exit codes of `pollen train` and the post-training commands (docs/training.md): schedulers
// tell these apart. rank_failed: in a job of several ranks, one died or hung (docs/parallel.md).
enum class RunStatus { finished = 0, failed = 1, preempted = 3, rank_failed = 4 };
// "finished", "preempted" or "failed", as summary.json says.
const char* run_status_name(RunStatus status);

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start);

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

// Returns the run folder's checkpoints/ folder; a run that does not resume is refused when
// checkpoints are already there. The caller creates the folder once the run's model is built,
// so that a run refused before (a wrong init_from, no GPU) leaves no empty folder behind.
std::filesystem::path check_run_dir(const std::filesystem::path& dir, bool resume);

// Warns when schedule.warmup_steps exceeds the run's steps: the rate never reaches its peak
// (a short test run of a long config), nor decays.
void warn_if_warmup_outlasts_run(const optim::Schedule& schedule);

// The loop's counters, saved in state.json and restored from it on resume.
struct LoopCounters {
  int64_t step = 0, tokens = 0;
  int64_t bad_in_row = 0, skipped = 0;  // non-finite steps: in a row now, in all
  double elapsed_before = 0;            // seconds the run ran before this process
  // The last step's loss and the last validation loss (NaN before any), which a resumed run
  // that has no step left to take still reports.
  double last_loss = NAN, last_val_loss = NAN;
  // The step of last_val_loss (-1: none; kValStepUnrecorded: at or before the checkpoint resumed
  // from, which did not record it): a run resumed without evaluating reports an earlier step's
  // validation loss as such.
  static constexpr int64_t kValStepUnrecorded = -2;
  int64_t last_val_step = -1;
  int64_t resumed_step = 0;  // the step restore() read: kValStepUnrecorded's bound
  // state.json's "step", "tokens", "bad_steps_in_row", "skipped_steps", "elapsed_s" (the
  // run's seconds so far, `elapsed_here` of them in this process), "last_loss",
  // "last_val_loss" and "last_val_step".
  // Records a validation loss measured at the current step.
  void record_validation(double loss) {
    last_val_loss = loss;
    last_val_step = step;
  }
  void save(nlohmann::ordered_json& state, double elapsed_here) const;
  void restore(const nlohmann::ordered_json& state);
  // Counts a step of `step_tokens` that ran; a bad one (non-finite loss, else gradient norm) is
  // counted as skipped and logged, after finishing the progress line.
  void count_step(int64_t step_tokens, bool good, double loss, int64_t max_bad_steps,
                  obs::Progress& progress);
  // Why a run stops at `at_step` after `max_bad_steps` bad steps in a row, naming its last good
  // checkpoint: among those beside `last_checkpoint` (the newest written) that verify, the newest
  // whose weights a later step trained on cleanly (finite loss and gradient norm). The last good
  // step's own update may be what diverged, so its checkpoint is not offered.
  // `start_key`: the run file's key that starts a new run from a checkpoint (model.init_from).
  std::string too_many_bad_steps(int64_t max_bad_steps,
                                 const std::filesystem::path& last_checkpoint, int64_t at_step,
                                 std::string_view start_key) const;
};

// What a training loop returns: how it ended, how far it got, and the line it ends with.
struct RunResult {
  RunStatus status = RunStatus::finished;
  int64_t step = 0, tokens = 0, skipped_steps = 0;
  double last_loss = NAN, last_val_loss = NAN;
  std::filesystem::path last_checkpoint;
  std::string message;
  // The counters' step, tokens and skipped steps, the last losses and the last checkpoint.
  void record(const LoopCounters& counters, double loss, double val_loss,
              const std::filesystem::path& checkpoint);
};

// The run's metrics files: metrics.jsonl and, with TensorBoard, an event file under
// dir/tensorboard. A resumed run continues both at the positions its checkpoint saved
// (`saved`: state.json's "metrics"); a fresh one starts the TensorBoard folder anew.
struct RunMetrics {
  obs::JsonlWriter jsonl;
  obs::EventFileWriter tb;  // not open without TensorBoard

  static RunMetrics open(const std::filesystem::path& dir, bool tensorboard,
                         const nlohmann::ordered_json* saved, int64_t step);
  void scalar(std::string_view tag, double value, int64_t step, double wall_time);
  // state.json's "metrics": "jsonl_bytes", "tensorboard_file", "tensorboard_bytes".
  nlohmann::ordered_json positions();
  void flush();
  void sync();
};

// Periodic checkpoints wait out a run of bad steps, so that the last one written is the last
// good state; a preemption always writes one (the run must be able to continue), and so does the
// last step (a skipped step changes no weight: they are those of the last good update, and a
// run without periodic checkpoints would otherwise end with none).
bool checkpoint_due(int64_t step, bool last, int64_t interval, int64_t bad_in_row, bool preempt);
std::string preempted_message(int64_t step, const std::filesystem::path& checkpoint);
// A job of several ranks that stops because one died or hung (`failure` says which).
RunResult rank_failed_result(const std::string& failure, const std::filesystem::path& run_dir);
// A run resumed after its last step trains nothing: its summary.json (of the run that did) stays,
// and this is the message to end with. Nothing when steps ran here, or when no summary says the
// run finished at `step` (none yet, or a preempted run's from before).
// The ranks of `comm` decide together (a collective), so that all of them end here or none: the
// run counts as finished only where every rank sees the summary.
std::optional<std::string> already_finished(bool resumed, int64_t steps_here,
                                            const std::filesystem::path& run_dir, int64_t step,
                                            const std::filesystem::path& checkpoint,
                                            dist::Communicator& comm);
// " (at step N)" when the last validation loss was measured before the run's last step (a
// resumed run that did not evaluate); empty otherwise.
std::string val_step_note(const LoopCounters& c);
std::string finished_message(const LoopCounters& counters, double seconds, double last_loss,
                             double last_val_loss, const std::filesystem::path& checkpoint);

// Makes one rank die, hang or throw an error before a step, or hang inside it once its first
// gradient bucket has started, to exercise failure detection (tests; set through
// POLLEN_FAULT_INJECT, docs/parallel.md).
struct FaultInjection {
  enum class Kind { none, kill, hang, hang_backward, error };
  Kind kind = Kind::none;
  int rank = 0;
  // before this step (1-based) runs; kill and hang at 0: before MPI starts; hang_backward: inside
  // it
  int64_t step = 0;
};
// Parses "kill:RANK:STEP", "hang:RANK:STEP", "hang_backward:RANK:STEP" or "error:RANK:STEP"; an
// empty text injects nothing.
FaultInjection parse_fault_injection(const std::string& text);
// POLLEN_FAULT_INJECT's fault (none when it is unset).
FaultInjection fault_from_environment();
// The job's ranks joined (dist::connect), after `f`'s fault before MPI starts (step 0) on the
// launcher's rank.
std::unique_ptr<dist::Communicator> connect_ranks(double timeout_s, const FaultInjection& f);
// Dies, hangs or throws as `f` says when this is its rank and the step about to run; for
// hang_backward, has `reducer` (this rank's; null for a process alone, which is refused) hang
// this rank once the step's first gradient bucket has started.
void inject_fault_at(const FaultInjection& f, int rank, int64_t step, dist::GradReducer* reducer);

double rss_mb();
double peak_rss_mb();

// JSON numbers for metrics: non-finite values become null (JSON has no NaN).
nlohmann::ordered_json json_number(double v);

// summary.json while a run trains (step of steps, from `step` on): {"status": "running", "step",
// "steps"}, so that a run that ends without its summary (killed, an error, a lost rank) does not
// leave an earlier run's "finished" in its place. Written only when steps are left to train.
void mark_running(const std::filesystem::path& run_dir, int64_t step, int64_t steps);

// While it lives on the rank that reports (`lead`), an error leaving its scope marks
// summary.json {"status": "failed", "step", "steps"} at the counters' step, so that a run an
// error stopped (a full disk, say) does not read as running; best effort, as the error may be
// the disk's.
class FailedSummaryOnError {
 public:
  FailedSummaryOnError(std::filesystem::path run_dir, const LoopCounters& counters, int64_t steps,
                       bool lead);
  ~FailedSummaryOnError();
  FailedSummaryOnError(const FailedSummaryOnError&) = delete;
  FailedSummaryOnError& operator=(const FailedSummaryOnError&) = delete;

 private:
  std::filesystem::path run_dir_;
  const LoopCounters& counters_;
  int64_t steps_;
  bool lead_;
  int uncaught_;
};

// summary.json's fields that every training run writes, in this order: status, step, steps,
// tokens, loss, val_loss, skipped_steps, elapsed_s (`seconds`, rounded to ms), peak_rss_mb and
// checkpoint. Each run adds its own after them.
nlohmann::ordered_json run_summary(RunStatus status, int64_t step, int64_t steps,
                                   const LoopCounters& counters, double last_loss,
                                   double last_val_loss, double seconds,
                                   const std::filesystem::path& checkpoint);

}  // namespace pollen::train
