#pragma once
// Dynamic loss scaling for fp16 (torch.amp.GradScaler's semantics): the loss is multiplied by
// `scale` before backward so that small gradients survive fp16; the gradients are divided by it
// again before clipping and the step. A step whose gradients hold an inf or NaN is skipped and
// the scale halves; after growth_interval clean steps in a row it doubles.
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <vector>

namespace qtrain::trainer {

struct LossScalerOptions {
  double initial_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  // A disabled scaler (bf16, fp32) has scale 1 and never changes; it still finds non-finite
  // gradients, which the trainer's NaN policy needs either way.
  explicit LossScaler(bool enabled, const LossScalerOptions& options = {});

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }

  // Divides the gradients of `parameters` by the scale, in place, and says whether all of
  // them are finite (parameters without a gradient are ignored).
  bool unscale_and_check(const std::vector<torch::Tensor>& parameters) const;
  // After each step: `skipped` backs the scale off and restarts the growth count.
  void update(bool skipped);

  // {"scale", "growth_tracker"}, for training-state checkpoints.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state, const std::string& source);

 private:
  bool enabled_;
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace qtrain::trainer
