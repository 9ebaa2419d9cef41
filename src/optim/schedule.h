// Learning-rate schedules, as a function of the optimizer step (0-based):
//   warmup:   lr · (step + 1) / warmup_steps for step < warmup_steps (nanoGPT/llm.c)
//   cosine:   then min_lr + (lr - min_lr) · ½(1 + cos(π · progress)) until max_steps
//   linear:   then lr → min_lr linearly until max_steps
//   constant: then lr
//   wsd:      warmup, stable at lr, and a linear decay to min_lr over the last
//             decay_frac · max_steps steps (warmup-stable-decay, MiniCPM)
// progress = (step - warmup) / (max_steps - warmup), clamped to [0, 1].
#pragma once

#include <cstdint>
#include <string>

namespace moetrain {

enum class ScheduleKind { cosine, linear, constant, wsd };

ScheduleKind parse_schedule(const std::string& name);

struct LrSchedule {
  ScheduleKind kind = ScheduleKind::cosine;
  double lr = 6e-4, min_lr = 6e-5;
  int64_t warmup_steps = 0, max_steps = 1;
  double decay_frac = 0.2;  // wsd only

  double at(int64_t step) const;
};

}  // namespace moetrain
