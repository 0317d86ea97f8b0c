#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "base/error.h"

namespace pollen::optim {

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "constant") return ScheduleKind::constant;
  if (name == "cosine") return ScheduleKind::cosine;
  if (name == "linear") return ScheduleKind::linear;
  if (name == "wsd") return ScheduleKind::wsd;
  fail("unknown schedule '", name, "': expected constant, cosine, linear or wsd");
}

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::constant:
      return "constant";
    case ScheduleKind::cosine:
      return "cosine";
    case ScheduleKind::linear:
      return "linear";
    case ScheduleKind::wsd:
      return "wsd";
  }
  return "?";
}

double lr_at(const Schedule& s, int64_t step) {
  if (step < s.warmup_steps) {
    return s.lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  const int64_t last = std::max<int64_t>(s.total_steps - 1, s.warmup_steps);
  auto progress = [](int64_t from, int64_t to, int64_t at) {
    if (to <= from) return 0.0;  // one step after warmup: it trains at the peak rate
    return std::clamp(static_cast<double>(at - from) / static_cast<double>(to - from), 0.0, 1.0);
  };
  switch (s.kind) {
    case ScheduleKind::constant:
      return s.lr;
    case ScheduleKind::cosine: {
      const double p = progress(s.warmup_steps, last, step);
      return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
    }
    case ScheduleKind::linear:
      return s.lr + (s.min_lr - s.lr) * progress(s.warmup_steps, last, step);
    case ScheduleKind::wsd: {
      // At least one decaying step whenever two or more follow warmup, so that the last is at
      // min_lr even in runs too short for the fraction to round to a step.
      const auto decay_steps =
          std::max<int64_t>(last > s.warmup_steps ? 1 : 0,
                            std::llround(s.decay_fraction * static_cast<double>(s.total_steps)));
      const int64_t start = std::max(s.warmup_steps, last - decay_steps);
      if (step <= start) return s.lr;
      return s.lr + (s.min_lr - s.lr) * progress(start, last, step);
    }
  }
  return s.lr;
}

}  // namespace pollen::optim
