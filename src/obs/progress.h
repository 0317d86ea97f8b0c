#pragma once
// Progress of long work: a bar with rate and ETA redrawn in place on a terminal, structured
// `key=value` lines (one every `line_interval` updates) when stderr is a file or a pipe.
#include <chrono>
#include <cstdint>
#include <string>

namespace pollen::obs {

// "1h02m", "3m05s", "12s"
std::string format_duration(double seconds);

// The bar's line: "label [####....] done/total fields eta 5s", cut to fit `columns` - 1
// characters when columns > 0 (a line that wrapped could not be redrawn in place): whole
// `fields` words go first, from the end, then the rest is cut.
std::string progress_line(const std::string& label, int64_t done, int64_t total,
                          const std::string& fields, const std::string& eta, int columns);

class Progress {
 public:
  // `total` units of work starting at `done` (a resumed run starts part way).
  Progress(std::string label, int64_t total, int64_t done = 0, int64_t line_interval = 1);
  // Reports `done` units with extra text ("loss 3.21 lr 1e-3"); returns the ETA in seconds.
  // The bar is redrawn at most every 0.1 s unless `force` (an event that must show at once).
  double update(int64_t done, const std::string& fields, bool force = false);
  void finish();  // ends the terminal line
  bool on_terminal() const { return tty_; }

 private:
  std::string label_;
  int64_t total_, start_done_, line_interval_;
  bool tty_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace pollen::obs
