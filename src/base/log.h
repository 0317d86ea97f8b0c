#pragma once
// Logging to stderr with a level threshold; lines are whole even when threads log at once.
#include <string_view>

#include "base/error.h"

namespace pollen::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3, off = 4 };

void set_level(Level level);
Level level();
void write(Level level, std::string_view message);

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
template <typename... Args>
void error(const Args&... a) {
  if (level() <= Level::error) write(Level::error, cat(a...));
}

}  // namespace pollen::log
