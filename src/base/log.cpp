#include "base/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace pollen::log {
namespace {
std::atomic<Level> g_level{Level::info};
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

void write(Level l, std::string_view message) {
  std::lock_guard lock(g_mutex);
  std::fprintf(stderr, "[pollen %s] %.*s\n", name(l), static_cast<int>(message.size()),
               message.data());
}

}  // namespace pollen::log
