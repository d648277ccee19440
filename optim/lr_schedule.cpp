#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace qtrain::optim {
namespace {

constexpr double kPi = 3.14159265358979323846;

void check(const LrScheduleOptions& options, int64_t step) {
  if (options.name != "cosine" && options.name != "linear" && options.name != "constant") {
    throw Error(ErrorCode::kRecipe, "schedule.name '" + options.name + "' is unknown; use cosine, linear or constant");
  }
  if (!(options.peak_lr >= 0.0)) throw Error(ErrorCode::kRecipe, "optim.lr must be >= 0, got " + std::to_string(options.peak_lr));
  if (options.warmup_steps < 0) {
    throw Error(ErrorCode::kRecipe, "schedule.warmup_steps must be >= 0, got " + std::to_string(options.warmup_steps));
  }
  if (options.total_steps < 1) {
    throw Error(ErrorCode::kRecipe, "the learning-rate schedule needs at least 1 training step (train.steps), got " +
                std::to_string(options.total_steps));
  }
  if (!(options.min_lr_ratio >= 0.0 && options.min_lr_ratio <= 1.0)) {
    throw Error(ErrorCode::kRecipe, "schedule.min_lr_ratio must lie in [0, 1], got " + std::to_string(options.min_lr_ratio));
  }
  if (step < 0) throw Error(ErrorCode::kInternal, "learning-rate schedule: step must be >= 0, got " + std::to_string(step));
}

double factor_at(const LrScheduleOptions& options, int64_t step) {
  if (step < options.warmup_steps) {
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, options.warmup_steps));
  }
  if (options.name == "constant") return 1.0;
  const double progress =
      std::clamp(static_cast<double>(step - options.warmup_steps) /
                     static_cast<double>(std::max<int64_t>(1, options.total_steps - options.warmup_steps)),
                 0.0, 1.0);
  const double decay = options.name == "cosine" ? 0.5 * (1.0 + std::cos(kPi * progress)) : 1.0 - progress;
  return options.min_lr_ratio + (1.0 - options.min_lr_ratio) * decay;
}

}  // namespace

double learning_rate_at(const LrScheduleOptions& options, int64_t step) {
  check(options, step);
  return options.peak_lr * factor_at(options, step);
}

}  // namespace qtrain::optim
