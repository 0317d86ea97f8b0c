#include "obs/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "base/error.h"
#include "base/log.h"

namespace pollen::obs {

std::string format_duration(double s) {
  // Past about 300 years an estimate says nothing (and llround would overflow near 9.2e18 s).
  if (!std::isfinite(s) || s < 0 || s > 1e10) return "?";
  const auto total = static_cast<int64_t>(std::llround(s));
  const int64_t h = total / 3600, m = total / 60 % 60, sec = total % 60;
  char buf[32];
  if (h > 0) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(h),
                  static_cast<long long>(m));
  } else if (m > 0) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(m),
                  static_cast<long long>(sec));
  } else {
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(sec));
  }
  return buf;
}

std::string progress_line(const std::string& label, int64_t done, int64_t total,
                          const std::string& fields, const std::string& eta, int columns) {
  constexpr int width = 24;
  // Clamped: a count past its total (or below 0) still draws a bar of `width`.
  const double frac =
      total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0) : 1;
  const int filled = static_cast<int>(frac * width);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(width - filled), '.');
  const std::string head = cat(label, " [", bar, "] ", done, "/", total);
  const std::string tail = cat(" eta ", eta);
  std::string shown = fields;
  if (columns <= 0) return cat(head, " ", shown, tail);
  const size_t room = static_cast<size_t>(columns - 1);
  while (!shown.empty() && head.size() + 1 + shown.size() + tail.size() > room) {
    const size_t space = shown.rfind(' ');
    shown.resize(space == std::string::npos ? 0 : space);
  }
  std::string line = shown.empty() ? head + tail : cat(head, " ", shown, tail);
  if (line.size() > room) line.resize(room);
  return line;
}

namespace {

// stderr's terminal width, 0 when unknown.
int terminal_columns() {
  winsize ws{};
  return ::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
}

}  // namespace

Progress::Progress(std::string label, int64_t total, int64_t done, int64_t line_interval)
    : label_(std::move(label)),
      total_(total),
      start_done_(done),
      line_interval_(line_interval > 0 ? line_interval : 1),
      tty_(::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

double Progress::update(int64_t done, const std::string& fields, bool force) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const int64_t progressed = done - start_done_;
  const double eta = progressed > 0 ? elapsed / static_cast<double>(progressed) *
                                          static_cast<double>(total_ - done)
                                    : NAN;
  if (tty_) {
    const bool last = done >= total_ || force;
    if (!last && std::chrono::duration<double>(now - last_draw_).count() < 0.1) return eta;
    last_draw_ = now;
    const std::string line =
        progress_line(label_, done, total_, fields, format_duration(eta), terminal_columns());
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
    std::fflush(stderr);
    drawn_ = true;
  } else if (done % line_interval_ == 0 || done >= total_) {
    log::info(label_, " step=", done, "/", total_, " ", fields, " eta=", format_duration(eta));
  }
  return eta;
}

void Progress::finish() {
  if (tty_ && drawn_) {
    std::fputc('\n', stderr);
    drawn_ = false;
  }
}

}  // namespace pollen::obs
