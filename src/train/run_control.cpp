#include "train/run_control.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string_view>
#include <thread>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "dist/grad_reducer.h"
#include "io/checkpoint.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) {
  // A second signal, of either kind, aborts at once: by its default action, raised here when it
  // reached another thread while the first was being handled, else as it comes.
  if (g_stop_signal.exchange(sig) != 0) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGINT, &dfl, nullptr);
  sigaction(SIGTERM, &dfl, nullptr);
  // Ranks that mpirun ends after another failed get SIGTERM too: their checkpoint may not come.
  static const char term[] =
      "\npollen: SIGTERM: finishing this step and writing a checkpoint, unless the job is being "
      "ended (send it again to abort at once)\n";
  static const char interrupt[] =
      "\npollen: SIGINT: finishing this step and writing a checkpoint, unless the job is being "
      "ended (send it again to abort at once)\n";
  const std::string_view msg =
      sig == SIGTERM ? std::string_view(term) : std::string_view(interrupt);
  [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg.data(), msg.size());
}

}  // namespace

struct SignalGuard::Saved {
  struct sigaction old_int {
  }, old_term{};
};

SignalGuard::SignalGuard(bool enable) : enabled_(enable) {
  g_stop_signal.store(0);
  if (!enabled_) return;
  saved_ = new Saved;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &saved_->old_int);
  sigaction(SIGTERM, &sa, &saved_->old_term);
}

SignalGuard::~SignalGuard() {
  if (!enabled_) return;
  sigaction(SIGINT, &saved_->old_int, nullptr);
  sigaction(SIGTERM, &saved_->old_term, nullptr);
  delete saved_;
}

bool stop_requested() {
  return g_stop_signal.load() != 0;
}

const char* run_status_name(RunStatus status) {
  return status == RunStatus::finished    ? "finished"
         : status == RunStatus::preempted ? "preempted"
                                          : "failed";
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

fs::path check_run_dir(const fs::path& dir, bool resume) {
  const fs::path ckpt_root = dir / "checkpoints";
  if (!resume) {
    POLLEN_CHECK(io::list_checkpoints(ckpt_root).empty(), "run folder '", dir.string(),
                 "' already holds checkpoints: pass --resume to continue it, or choose another ",
                 "run.dir");
  }
  return ckpt_root;
}

void warn_if_warmup_outlasts_run(const optim::Schedule& s) {
  if (s.warmup_steps <= s.total_steps) return;
  log::warn_job("schedule.warmup_steps (", s.warmup_steps, ") is more than train.steps (",
                s.total_steps, "): the rate rises to ",
                s.lr * static_cast<double>(s.total_steps) / static_cast<double>(s.warmup_steps),
                " at most, never reaching optimizer.lr (", s.lr, "), and does not decay");
}

void LoopCounters::save(nlohmann::ordered_json& st, double elapsed_here) const {
  st["step"] = step;
  st["tokens"] = tokens;
  st["bad_steps_in_row"] = bad_in_row;
  st["skipped_steps"] = skipped;
  st["elapsed_s"] = elapsed_before + elapsed_here;
  st["last_loss"] = json_number(last_loss);
  st["last_val_loss"] = json_number(last_val_loss);
  st["last_val_step"] = last_val_step;
}

void LoopCounters::restore(const nlohmann::ordered_json& st) {
  step = resumed_step = st.at("step").get<int64_t>();
  tokens = st.at("tokens").get<int64_t>();
  bad_in_row = st.at("bad_steps_in_row").get<int64_t>();
  skipped = st.at("skipped_steps").get<int64_t>();
  elapsed_before = st.at("elapsed_s").get<double>();
  // Checkpoints before these were recorded have none: NaN, as before any step.
  const auto number = [&](const char* key) {
    return st.contains(key) && st.at(key).is_number() ? st.at(key).get<double>() : NAN;
  };
  last_loss = number("last_loss");
  last_val_loss = number("last_val_loss");
  if (st.contains("last_val_step") && st.at("last_val_step").is_number_integer())
    last_val_step = st.at("last_val_step").get<int64_t>();
  else
    last_val_step = std::isnan(last_val_loss) ? -1 : kValStepUnrecorded;
}

RunResult rank_failed_result(const std::string& failure, const fs::path& run_dir) {
  RunResult r;
  r.status = RunStatus::rank_failed;
  const fs::path checkpoints = run_dir / "checkpoints";
  r.message = io::list_checkpoints(checkpoints).empty()
                  ? cat(failure, "; stopping the job. It wrote no checkpoint yet ('",
                        checkpoints.string(), "'): rerun it (with --resume, it starts at step 0)")
                  : cat(failure, "; stopping the job. Rerun it with --resume to continue from the ",
                        "last checkpoint under '", checkpoints.string(), "'");
  return r;
}

void RunResult::record(const LoopCounters& counters, double loss, double val_loss,
                       const fs::path& checkpoint) {
  step = counters.step;
  tokens = counters.tokens;
  skipped_steps = counters.skipped;
  last_loss = loss;
  last_val_loss = val_loss;
  last_checkpoint = checkpoint;
}

void LoopCounters::count_step(int64_t step_tokens, bool good, double loss, int64_t max_bad_steps,
                              obs::Progress& progress) {
  ++step;
  tokens += step_tokens;
  if (good) {
    bad_in_row = 0;
    return;
  }
  ++bad_in_row;
  ++skipped;
  progress.finish();
  log::warn_job("step ", step, ": non-finite ", std::isfinite(loss) ? "gradient norm" : "loss",
                "; update skipped (", bad_in_row, " in a row, stop at ", max_bad_steps, ")");
}

std::string LoopCounters::too_many_bad_steps(int64_t max_bad_steps, const fs::path& last_checkpoint,
                                             int64_t at_step, std::string_view start_key) const {
  const std::string stopping =
      cat(bad_in_row, " non-finite steps in a row (train.max_bad_steps = ", max_bad_steps,
          "); stopping. The last good checkpoint is ");
  // The last good step (at_step - bad_in_row: finite loss and gradient norm) trained cleanly
  // on the weights of the step before it; its own update may be what diverged.
  const int64_t vouched = at_step - bad_in_row - 1;
  fs::path good;
  if (!last_checkpoint.empty())
    for (const fs::path& c : io::list_checkpoints(last_checkpoint.parent_path()))
      if (!io::verify_checkpoint(c, {"model.safetensors"}) && io::checkpoint_step(c) <= vouched)
        good = c;
  if (good.empty()) {
    const std::string why =
        last_checkpoint.empty()
            ? std::string("no checkpoint was written")
            : cat("the newest, '", last_checkpoint.string(), "', holds step ",
                  io::checkpoint_step(last_checkpoint), "'s update, which may be what diverged");
    return cat(stopping, "none (", why,
               "); lower optimizer.lr or raise schedule.warmup_steps and start again");
  }
  return cat(stopping, "'", good.string(),
             "'; to go on from it with a lower optimizer.lr or more schedule.warmup_steps (which "
             "--resume keeps as they were), start a new run with ",
             start_key, " set to it");
}

RunMetrics RunMetrics::open(const fs::path& dir, bool tensorboard,
                            const nlohmann::ordered_json* saved, int64_t step) {
  RunMetrics m;
  // A fresh run in a folder an earlier run used: that run's evaluations (pollen eval --run) are of
  // other weights under the same step numbers.
  if (!saved && fs::exists(dir / "eval.jsonl")) {
    // Added to what an earlier resume or fresh run set aside there, never in its place; as
    // below, a kill between the steps loses the results rather than setting them aside twice.
    if (!fs::exists(dir / "eval.jsonl.old")) {
      fs::rename(dir / "eval.jsonl", dir / "eval.jsonl.old");
    } else {
      const std::string both = read_file(dir / "eval.jsonl.old") + read_file(dir / "eval.jsonl");
      fs::remove(dir / "eval.jsonl");
      write_file_atomic(dir / "eval.jsonl.old", both);
    }
    log::warn("a fresh run in '", dir.string(), "': its eval.jsonl, of an earlier run's ",
              "checkpoints, is added to eval.jsonl.old");
  }
  // A resumed run trains the steps after its checkpoint again: results of checkpoints past it
  // are of weights set aside, and eval --run would take them as done. They go to eval.jsonl.old.
  if (saved && fs::exists(dir / "eval.jsonl")) {
    std::ifstream in(dir / "eval.jsonl");
    std::string kept, set_aside, line;
    int64_t moved = 0;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      const bool past = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                        j["step"].get<int64_t>() > step;
      (past ? set_aside : kept) += line + "\n";
      moved += past ? 1 : 0;
    }
    in.close();
    if (moved > 0) {
      const std::string old =
          fs::exists(dir / "eval.jsonl.old") ? read_file(dir / "eval.jsonl.old") : std::string();
      // eval.jsonl first: a kill between the two loses the set-aside results rather than
      // setting them aside twice.
      write_file_atomic(dir / "eval.jsonl", kept);
      write_file_atomic(dir / "eval.jsonl.old", old + set_aside);
      log::warn("resume from step ", step, ": ", moved, " result(s) of eval.jsonl, of checkpoints ",
                "past it that this run trains again, moved to eval.jsonl.old");
    }
  }
  m.jsonl =
      obs::JsonlWriter(dir / "metrics.jsonl", saved ? saved->at("jsonl_bytes").get<uint64_t>() : 0,
                       obs::Shortfall::keep_whole_lines);
  if (!tensorboard) return m;
  const fs::path tb_dir = dir / "tensorboard";
  const std::string tb_file = saved ? saved->at("tensorboard_file").get<std::string>() : "";
  if (!tb_file.empty() && fs::exists(tb_dir / tb_file)) {
    m.tb = obs::EventFileWriter::resume(tb_dir / tb_file,
                                        saved->at("tensorboard_bytes").get<uint64_t>(), step + 1);
  } else {
    if (step == 0) fs::remove_all(tb_dir);  // a fresh run: no stale curves
    if (!tb_file.empty())
      log::warn("'", (tb_dir / tb_file).string(), "' is missing: going on with a new file (this ",
                "run's TensorBoard curves before step ", step + 1, " are gone)");
    fs::create_directories(tb_dir);
    m.tb = obs::EventFileWriter::create(tb_dir, step + 1);
  }
  return m;
}

void RunMetrics::scalar(std::string_view tag, double value, int64_t step, double wall_time) {
  if (tb.file().is_open()) tb.add_scalar(tag, value, step, wall_time);
}

nlohmann::ordered_json RunMetrics::positions() {
  const bool open = tb.file().is_open();
  return {{"jsonl_bytes", jsonl.file().position()},
          {"tensorboard_file", open ? tb.file().path().filename().string() : std::string()},
          {"tensorboard_bytes", open ? tb.file().position() : 0}};
}

void RunMetrics::flush() {
  jsonl.file().flush();
  if (tb.file().is_open()) tb.file().flush();
}

void RunMetrics::sync() {
  jsonl.file().sync();
  if (tb.file().is_open()) tb.file().sync();
}

bool checkpoint_due(int64_t step, bool last, int64_t interval, int64_t bad_in_row, bool preempt) {
  return preempt || last || (interval > 0 && step % interval == 0 && bad_in_row == 0);
}

namespace {

// Whether the run folder's summary.json says the run finished at `step`. One written earlier (a
// preemption's), or one that does not read, is to be written again.
bool summary_says_finished_at(const fs::path& run_dir, int64_t step) {
  const fs::path file = run_dir / "summary.json";
  if (!fs::exists(file)) return false;
  const auto summary = nlohmann::json::parse(read_file(file), nullptr, false);
  return summary.is_object() && summary.value("status", "") == "finished" &&
         summary.value("step", int64_t{-1}) == step;
}

}  // namespace

std::optional<std::string> already_finished(bool resumed, int64_t steps_here,
                                            const fs::path& run_dir, int64_t step,
                                            const fs::path& checkpoint, dist::Communicator& comm) {
  double seen[1] = {resumed && steps_here == 0 && summary_says_finished_at(run_dir, step) ? 1.0
                                                                                          : 0.0};
  comm.all_reduce_sum(seen, "whether the run had already finished");
  if (seen[0] < comm.world()) return std::nullopt;
  return cat("the run had already finished at step ", step, " (checkpoint '", checkpoint.string(),
             "'); nothing to do, summary.json kept");
}

std::string preempted_message(int64_t step, const fs::path& checkpoint) {
  return cat("preempted at step ", step, "; checkpoint saved to '", checkpoint.string(),
             "'; continue with --resume");
}

std::string val_step_note(const LoopCounters& c) {
  if (c.last_val_step == LoopCounters::kValStepUnrecorded)
    return cat(" (at or before step ", c.resumed_step, ")");
  return c.last_val_step >= 0 && c.last_val_step < c.step ? cat(" (at step ", c.last_val_step, ")")
                                                          : std::string();
}

std::string finished_message(const LoopCounters& c, double seconds, double last_loss,
                             double last_val_loss, const fs::path& checkpoint) {
  // A run without validation data (or evaluation) has no validation loss to show.
  const std::string validation = std::isnan(last_val_loss)
                                     ? std::string()
                                     : cat(", validation loss ", last_val_loss, val_step_note(c));
  return cat("finished ", c.step, " steps (", c.tokens, " tokens) in ",
             obs::format_duration(seconds), ": loss ", last_loss, validation, ", ", c.skipped,
             " steps skipped; checkpoint '", checkpoint.string(), "'");
}

FaultInjection parse_fault_injection(const std::string& text) {
  FaultInjection f;
  if (text.empty()) return f;
  const auto a = text.find(':'), b = text.rfind(':');
  const std::string kind = text.substr(0, a);
  try {
    POLLEN_CHECK(
        a != std::string::npos && b != a &&
            (kind == "kill" || kind == "hang" || kind == "hang_backward" || kind == "error"),
        "");
    size_t used = 0;
    f.rank = std::stoi(text.substr(a + 1, b - a - 1), &used);
    POLLEN_CHECK(used == b - a - 1, "");
    f.step = std::stoll(text.substr(b + 1), &used);
    const int64_t first_step = kind == "kill" || kind == "hang" ? 0 : 1;
    POLLEN_CHECK(used == text.size() - b - 1 && f.rank >= 0 && f.step >= first_step, "");
  } catch (const std::exception&) {
    fail("POLLEN_FAULT_INJECT='", text,
         "': expected kill:RANK:STEP, hang:RANK:STEP (STEP 0: before MPI starts), "
         "hang_backward:RANK:STEP or error:RANK:STEP (STEP from 1)");
  }
  f.kind = kind == "kill"            ? FaultInjection::Kind::kill
           : kind == "hang"          ? FaultInjection::Kind::hang
           : kind == "hang_backward" ? FaultInjection::Kind::hang_backward
                                     : FaultInjection::Kind::error;
  return f;
}

FaultInjection fault_from_environment() {
  const char* text = std::getenv("POLLEN_FAULT_INJECT");
  return parse_fault_injection(text ? text : "");
}

std::unique_ptr<dist::Communicator> connect_ranks(double timeout_s, const FaultInjection& f) {
  inject_fault_at(f, dist::topology_from_environment().rank, 0, nullptr);
  return dist::connect(timeout_s);
}

namespace {

[[noreturn]] void hang_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace

void inject_fault_at(const FaultInjection& f, int rank, int64_t step, dist::GradReducer* reducer) {
  if (f.kind == FaultInjection::Kind::none || f.rank != rank || f.step != step) return;
  if (f.kind == FaultInjection::Kind::error)
    fail("rank ", f.rank, ": POLLEN_FAULT_INJECT: an error before step ", f.step);
  if (f.kind == FaultInjection::Kind::hang_backward) {
    POLLEN_CHECK(reducer, "POLLEN_FAULT_INJECT: hang_backward needs a job of several ranks (it ",
                 "hangs a rank once a gradient bucket's reduction has started)");
    // Once hanging, this rank never returns to MPI, so the started reduction cannot finish.
    reducer->on_bucket_started([f](size_t bucket) {
      log::warn("rank ", f.rank, ": POLLEN_FAULT_INJECT: hanging in step ", f.step,
                " after the gradient reduction of bucket ", bucket, " started");
      hang_forever();
    });
    return;
  }
  log::warn("rank ", f.rank,
            ": POLLEN_FAULT_INJECT: ", f.kind == FaultInjection::Kind::kill ? "dying" : "hanging",
            f.step == 0 ? std::string(" before MPI starts") : cat(" before step ", f.step));
  if (f.kind == FaultInjection::Kind::kill) ::raise(SIGKILL);
  hang_forever();
}

double rss_mb() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
}

double peak_rss_mb() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

nlohmann::ordered_json json_number(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
}

void mark_running(const fs::path& run_dir, int64_t step, int64_t steps) {
  if (step >= steps) return;  // nothing to train: a finished run's summary stays
  const nlohmann::ordered_json running{{"status", "running"}, {"step", step}, {"steps", steps}};
  write_file_atomic(run_dir / "summary.json", running.dump(2) + "\n");
}

FailedSummaryOnError::FailedSummaryOnError(fs::path run_dir, const LoopCounters& counters,
                                           int64_t steps, bool lead)
    : run_dir_(std::move(run_dir)),
      counters_(counters),
      steps_(steps),
      lead_(lead),
      uncaught_(std::uncaught_exceptions()) {}

FailedSummaryOnError::~FailedSummaryOnError() {
  if (!lead_ || std::uncaught_exceptions() <= uncaught_) return;
  try {
    const nlohmann::ordered_json failed{{"status", run_status_name(RunStatus::failed)},
                                        {"step", counters_.step},
                                        {"steps", steps_}};
    write_file_atomic(run_dir_ / "summary.json", failed.dump(2) + "\n");
  } catch (...) {  // the error on its way out says what went wrong
  }
}

nlohmann::ordered_json run_summary(RunStatus status, int64_t step, int64_t steps,
                                   const LoopCounters& counters, double last_loss,
                                   double last_val_loss, double seconds,
                                   const std::filesystem::path& checkpoint) {
  nlohmann::ordered_json summary;
  summary["status"] = run_status_name(status);
  summary["step"] = step;
  summary["steps"] = steps;
  summary["tokens"] = counters.tokens;
  summary["loss"] = json_number(last_loss);
  summary["val_loss"] = json_number(last_val_loss);
  // The step it was measured at (null: unknown), an earlier one's when this run did not evaluate.
  summary["val_loss_step"] = std::isnan(last_val_loss) || counters.last_val_step < 0
                                 ? nlohmann::ordered_json(nullptr)
                                 : nlohmann::ordered_json(counters.last_val_step);
  summary["skipped_steps"] = counters.skipped;
  summary["elapsed_s"] = std::round(seconds * 1000) / 1000;
  summary["peak_rss_mb"] = std::round(peak_rss_mb());
  summary["checkpoint"] = checkpoint.string();
  return summary;
}

}  // namespace pollen::train
