#include "train/run_control.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>

#include "base/error.h"
#include "base/log.h"
#include "io/checkpoint.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
  static const char msg[] =
      "\npollen: stop requested; finishing this step and writing a checkpoint "
      "(send it again to abort at once)\n";
  [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
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
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
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

ResumePoint choose_checkpoint_to_resume(const fs::path& root) {
  const auto choice = io::choose_resume_checkpoint(root);
  for (const auto& [dir, why] : choice.skipped)
    log::warn("skipping checkpoint '", dir.string(), "': ", why);
  const ResumePoint point{choice.dir, static_cast<int64_t>(choice.skipped.size())};
  if (!choice.dir) return point;
  for (const auto& [bad, why] : choice.skipped) {
    const fs::path aside = bad.parent_path() / cat(".corrupt-", bad.filename().string());
    fs::remove_all(aside);
    fs::rename(bad, aside);
    log::warn("moved '", bad.string(), "' aside to '", aside.string(), "'");
  }
  return point;
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

}  // namespace pollen::train
