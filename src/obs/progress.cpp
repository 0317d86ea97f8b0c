#include "obs/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "base/error.h"
#include "base/log.h"

namespace pollen::obs {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
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
    constexpr int width = 24;
    const double frac = total_ > 0 ? static_cast<double>(done) / static_cast<double>(total_) : 1;
    const int filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(width - filled), '.');
    std::fprintf(stderr, "\r\033[K%s [%s] %lld/%lld %s eta %s", label_.c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), fields.c_str(),
                 format_duration(eta).c_str());
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
