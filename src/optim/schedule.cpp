#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moetrain {

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "cosine") return ScheduleKind::cosine;
  if (name == "linear") return ScheduleKind::linear;
  if (name == "constant") return ScheduleKind::constant;
  if (name == "wsd") return ScheduleKind::wsd;
  MT_THROW("unknown learning-rate schedule '{}' (expected cosine, linear, constant or wsd)", name);
}

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  switch (kind) {
    case ScheduleKind::constant: return lr;
    case ScheduleKind::cosine:
    case ScheduleKind::linear: {
      double span = static_cast<double>(std::max<int64_t>(1, max_steps - warmup_steps));
      double progress = std::clamp(static_cast<double>(step - warmup_steps) / span, 0.0, 1.0);
      double coef = kind == ScheduleKind::cosine ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
      return min_lr + (lr - min_lr) * coef;
    }
    case ScheduleKind::wsd: {
      int64_t decay_steps = static_cast<int64_t>(std::llround(decay_frac * static_cast<double>(max_steps)));
      int64_t decay_start = std::max(warmup_steps, max_steps - decay_steps);
      if (step < decay_start) return lr;
      double span = static_cast<double>(std::max<int64_t>(1, max_steps - decay_start));
      double progress = std::clamp(static_cast<double>(step - decay_start) / span, 0.0, 1.0);
      return lr + (min_lr - lr) * progress;
    }
  }
  return lr;
}

}  // namespace moetrain
