#include "base/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>

namespace pollen::log {
namespace {
std::atomic<Level> g_level{Level::info};
std::atomic<bool> g_follower{false};
std::mutex g_mutex;
const char* name(Level l) {
  switch (l) {
    case Level::debug:
      return "debug";
    case Level::info:
      return "info";
    case Level::warn:
      return "warn";
    case Level::error:
      return "error";
    default:
      return "";
  }
}
}  // namespace

void set_level(Level l) {
  g_level = l;
}
Level level() {
  return g_level;
}
void follow_job_lead() {
  g_follower = true;
  g_level = std::max(g_level.load(), Level::warn);
}
bool follows_job_lead() {
  return g_follower;
}

void write(Level l, std::string_view message) {
  // On a terminal a line starts by wiping what a progress bar (obs/progress.h) drew in place, so
  // that a message never runs into the bar; the bar's next update draws it again below.
  static const bool tty = ::isatty(STDERR_FILENO) == 1;
  std::lock_guard lock(g_mutex);
  std::fprintf(stderr, "%s[pollen %s] %.*s\n", tty ? "\r\033[K" : "", name(l),
               static_cast<int>(message.size()), message.data());
}

}  // namespace pollen::log
