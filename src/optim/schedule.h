#pragma once
// Learning-rate schedules: linear warmup, then constant, cosine, linear or WSD
// (warmup-stable-decay) down to a minimum. `step` is 0-based: lr_at(s, 0) is the rate of the
// first update. After warmup, progress p runs from 0 at step `warmup_steps` to 1 at the last
// step (total_steps - 1), so the last update uses exactly min_lr (constant excepted; a run with
// a single step after warmup takes it at lr).
//
//   constant: lr
//   cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
//   linear:   lr + (min_lr - lr) * p
//   wsd:      lr until the last decay_fraction of all steps, then linear down to min_lr
#include <cstdint>
#include <string>

namespace pollen::optim {

enum class ScheduleKind { constant, cosine, linear, wsd };

ScheduleKind parse_schedule_kind(const std::string& name);  // throws listing the kinds
const char* schedule_kind_name(ScheduleKind kind);

struct Schedule {
  ScheduleKind kind = ScheduleKind::cosine;
  double lr = 3e-4, min_lr = 0;
  int64_t warmup_steps = 0, total_steps = 1;
  double decay_fraction = 0.2;  // wsd only
};

double lr_at(const Schedule& s, int64_t step);

}  // namespace pollen::optim
