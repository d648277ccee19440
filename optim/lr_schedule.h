#pragma once
// Learning-rate schedules with linear warmup, as transformers' get_cosine_schedule_with_warmup
// (and get_cosine_with_min_lr_schedule_with_warmup), get_linear_schedule_with_warmup and
// get_constant_schedule_with_warmup. For optimizer step s (counted from 0):
//   warmup   (s < warmup_steps):  factor = s / max(1, warmup_steps)
//   progress = (s - warmup_steps) / max(1, total_steps - warmup_steps), clamped to [0, 1]
//   cosine:   factor = min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * progress))
//   linear:   factor = min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)
//   constant: factor = 1
//   lr = peak_lr * factor
// With min_lr_ratio = 0 these are transformers' formulas exactly for s <= total_steps; the
// clamp only matters past total_steps, where transformers' cosine would rise again and ours
// stays at min_lr_ratio * peak_lr.
#include <cstdint>
#include <string>

namespace qtrain::optim {

struct LrScheduleOptions {
  std::string name = "cosine";  // cosine | linear | constant
  double peak_lr = 2e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.0;  // the floor of cosine / linear decay, as a fraction of peak_lr
};

// The learning rate for optimizer step `step` (0-based). Throws qtrain::Error for options a user
// could not have meant (unknown name, negative counts, min_lr_ratio outside [0, 1]).
double learning_rate_at(const LrScheduleOptions& options, int64_t step);

}  // namespace qtrain::optim
