#include "trainer/loss_scaler.h"

#include <map>

#include "kernels/error.h"

namespace qtrain::trainer {

LossScaler::LossScaler(bool enabled, const LossScalerOptions& options)
    : enabled_(enabled), options_(options), scale_(enabled ? options.initial_scale : 1.0) {}

bool LossScaler::unscale_and_check(const std::vector<torch::Tensor>& parameters) const {
  std::vector<torch::Tensor> gradients;
  for (const auto& parameter : parameters) {
    if (parameter.grad().defined()) gradients.push_back(parameter.grad());
  }
  if (gradients.empty()) return true;
  // One flag and one inverse scale per device (and dtype), as GradScaler keeps them.
  std::map<std::pair<std::string, torch::ScalarType>, std::vector<torch::Tensor>> by_device;
  for (const auto& gradient : gradients) by_device[{gradient.device().str(), gradient.scalar_type()}].push_back(gradient);
  bool finite = true;
  for (auto& [key, group] : by_device) {
    if (key.second == torch::kBFloat16) {
      // CUDA's fused check takes fp32 and fp16 gradients only; bf16 ones (a full fine-tune in
      // bf16, where the scale stays 1) are checked through their norms, which an inf or NaN reaches.
      if (scale_ != 1.0) torch::_foreach_mul_(group, 1.0 / scale_);
      finite = finite && torch::isfinite(torch::stack(torch::_foreach_norm(group))).all().item<bool>();
      continue;
    }
    const auto options = torch::TensorOptions().dtype(torch::kFloat32).device(group.front().device());
    auto found_nonfinite = torch::zeros({1}, options);
    const auto inverse_scale = torch::full({1}, 1.0 / scale_, options);
    at::_amp_foreach_non_finite_check_and_unscale_(group, found_nonfinite, inverse_scale);
    finite = finite && found_nonfinite.item<float>() == 0.0f;
  }
  return finite;
}

void LossScaler::update(bool skipped) {
  if (!enabled_) return;
  if (skipped) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    return;
  }
  if (++growth_tracker_ == options_.growth_interval) {
    scale_ *= options_.growth_factor;
    growth_tracker_ = 0;
  }
}

nlohmann::json LossScaler::state() const { return {{"scale", scale_}, {"growth_tracker", growth_tracker_}}; }

void LossScaler::load_state(const nlohmann::json& state, const std::string& source) {
  if (!state.is_object() || !state.contains("scale") || !state["scale"].is_number() ||
      !state.contains("growth_tracker") || !state["growth_tracker"].is_number_integer()) {
    throw Error(ErrorCode::kCheckpoint, source + ": the loss scaler state needs a number \"scale\" and an integer \"growth_tracker\"");
  }
  scale_ = state["scale"].get<double>();
  growth_tracker_ = state["growth_tracker"].get<int64_t>();
  if (!(scale_ > 0) || growth_tracker_ < 0) throw Error(ErrorCode::kCheckpoint, source + ": the loss scaler state is out of range");
}

}  // namespace qtrain::trainer
