#pragma once
// Logging to stderr with a level threshold; lines are whole even when threads log at once.
#include <string_view>

#include "base/error.h"

namespace pollen::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3, off = 4 };

void set_level(Level level);
Level level();
void write(Level level, std::string_view message);
// On a rank other than a job's rank 0, which reports for the job: from here on only warnings and
// errors, and none of warn_job's.
void follow_job_lead();
bool follows_job_lead();

template <typename... Args>
void debug(const Args&... a) {
  if (level() <= Level::debug) write(Level::debug, cat(a...));
}
template <typename... Args>
void info(const Args&... a) {
  if (level() <= Level::info) write(Level::info, cat(a...));
}
template <typename... Args>
void warn(const Args&... a) {
  if (level() <= Level::warn) write(Level::warn, cat(a...));
}
// A warning about what every rank of a job shares (its run file, checkpoint, data or global
// loss), given once: by rank 0 alone.
template <typename... Args>
void warn_job(const Args&... a) {
  if (!follows_job_lead() && level() <= Level::warn) write(Level::warn, cat(a...));
}
template <typename... Args>
void error(const Args&... a) {
  if (level() <= Level::error) write(Level::error, cat(a...));
}

}  // namespace pollen::log
