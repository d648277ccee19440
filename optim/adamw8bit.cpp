#include "optim/adamw8bit.h"

#include <cmath>

#include "kernels/adamw8bit_step.h"
#include "kernels/blockwise_8bit.h"
#include "kernels/error.h"

namespace qtrain::optim {

namespace {

int64_t state_blocks(const torch::Tensor& parameter) {
  return (parameter.numel() + kOptimizerStateBlocksize - 1) / kOptimizerStateBlocksize;
}

// The bias corrections of step t as bnb's kernels take them, in fp32.
struct AdamStepScalars {
  float beta1, beta2, eps, lr, decay_factor;  // decay_factor = 1 - lr * weight_decay
  float correction2;                          // sqrt(1 - beta2^t)
  float step_size;                            // -lr * correction2 / (1 - beta1^t)
};

AdamStepScalars step_scalars(const AdamWOptions& options, double learning_rate, int64_t step) {
  AdamStepScalars scalars{};
  scalars.beta1 = static_cast<float>(options.beta1);
  scalars.beta2 = static_cast<float>(options.beta2);
  scalars.eps = static_cast<float>(options.eps);
  scalars.lr = static_cast<float>(learning_rate);
  scalars.decay_factor = 1.0f - scalars.lr * static_cast<float>(options.weight_decay);
  const float t = static_cast<float>(step);
  const float correction1 = 1.0f - std::pow(scalars.beta1, t);
  scalars.correction2 = std::sqrt(1.0f - std::pow(scalars.beta2, t));
  scalars.step_size = -scalars.lr * scalars.correction2 / correction1;
  return scalars;
}

}  // namespace

AdamW8bit::AdamW8bit(std::vector<torch::Tensor> parameters, const AdamW8bitOptions& options)
    : Optimizer(std::move(parameters), options.adamw.lr, "adamw8bit"), options_(options) {
  check_adamw_options(options.adamw);
  if (options.min_8bit_size < 0) throw Error(ErrorCode::kRecipe, "adamw8bit: min_8bit_size must be >= 0");
}

bool AdamW8bit::has_8bit_state(size_t index) const {
  return parameters_[index].numel() >= options_.min_8bit_size;
}

std::vector<std::string> AdamW8bit::state_fields(size_t index) const {
  std::vector<std::string> fields{"step"};
  if (has_8bit_state(index)) {
    fields.insert(fields.end(), {"state1", "state2", "absmax1", "absmax2"});
  } else {
    fields.insert(fields.end(), {"exp_avg", "exp_avg_sq"});
  }
  if (needs_master(parameters_[index])) fields.emplace_back("master");
  return fields;
}

Optimizer::StateTensorSpec AdamW8bit::state_tensor_spec(size_t index, const std::string& field) const {
  const auto& parameter = parameters_[index];
  if (field == "state1" || field == "state2") return {parameter.sizes().vec(), torch::kUInt8};
  if (field == "absmax1" || field == "absmax2") return {{state_blocks(parameter)}, torch::kFloat};
  if (field == "exp_avg" || field == "exp_avg_sq") return {parameter.sizes().vec(), torch::kFloat};
  return Optimizer::state_tensor_spec(index, field);
}

void AdamW8bit::initialise_state(size_t index) {
  auto& fields = parameter_state_[index];
  if (!fields.empty()) return;
  const auto& parameter = parameters_[index];
  update_target(index);  // creates the master of a low-precision parameter
  const auto fp32 = parameter.options().dtype(torch::kFloat);
  fields["step"] = torch::zeros({}, fp32);
  if (has_8bit_state(index)) {
    // bnb starts from zero codes and zero absmax: both moments dequantize to 0.
    fields["state1"] = torch::zeros(parameter.sizes(), parameter.options().dtype(torch::kUInt8));
    fields["state2"] = torch::zeros(parameter.sizes(), parameter.options().dtype(torch::kUInt8));
    fields["absmax1"] = torch::zeros({state_blocks(parameter)}, fp32);
    fields["absmax2"] = torch::zeros({state_blocks(parameter)}, fp32);
  } else {
    fields["exp_avg"] = torch::zeros(parameter.sizes(), fp32);
    fields["exp_avg_sq"] = torch::zeros(parameter.sizes(), fp32);
  }
}

void AdamW8bit::step() {
  torch::NoGradGuard no_grad;
  std::vector<size_t> stepped;
  std::vector<torch::Tensor> steps;
  for (size_t index = 0; index < parameters_.size(); ++index) {
    if (!parameters_[index].grad().defined()) continue;
    initialise_state(index);
    stepped.push_back(index);
    steps.push_back(parameter_state_[index].at("step"));
  }
  if (stepped.empty()) return;
  torch::_foreach_add_(steps, 1);
  // The counts reach the host in one copy: reading them one by one waited on the GPU per parameter.
  const auto counts = torch::stack(steps).to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* count = counts.data_ptr<int64_t>();
  for (size_t k = 0; k < stepped.size(); ++k) {
    const size_t index = stepped[k];
    const int64_t step = count[k];
    if (has_8bit_state(index)) {
      step_8bit(index, step);
    } else {
      step_32bit(index, step);
    }
    write_back_master(index);
  }
}

const std::pair<torch::Tensor, torch::Tensor>& AdamW8bit::dynamic_maps(const torch::Device& device) {
  if (!device_maps_.first.defined() || device_maps_.first.device() != device) {
    device_maps_ = {kernels::signed_dynamic_map().to(device), kernels::unsigned_dynamic_map().to(device)};
  }
  return device_maps_;
}

void AdamW8bit::step_8bit(size_t index, int64_t step) {
  auto& target = update_target(index);
  const bool fused = options_.fused_cuda_step && kernels::kCudaKernelsBuilt && target.is_cuda() &&
                     target.scalar_type() == torch::kFloat && target.is_contiguous();
  if (!fused) return step_8bit_reference(index, step);
  auto& fields = parameter_state_[index];
  const auto s = step_scalars(options_.adamw, learning_rate_, step);
  const auto grad = gradient_for_update(index).to(torch::kFloat).contiguous();
  const auto& [signed_map, unsigned_map] = dynamic_maps(target.device());
  kernels::AdamW8bitStepScalars scalars{};
  scalars.beta1 = s.beta1;
  scalars.beta2 = s.beta2;
  scalars.one_minus_beta1 = 1.0f - s.beta1;
  scalars.one_minus_beta2 = 1.0f - s.beta2;
  scalars.eps_term = s.correction2 * s.eps;
  scalars.step_size = s.step_size;
  scalars.decay_factor = s.decay_factor;
  scalars.apply_decay = options_.adamw.weight_decay > 0.0;
  kernels::adamw8bit_step_cuda(target, grad, fields.at("state1"), fields.at("absmax1"), fields.at("state2"),
                               fields.at("absmax2"), signed_map, unsigned_map, scalars);
}

void AdamW8bit::step_8bit_reference(size_t index, int64_t step) {
  auto& fields = parameter_state_[index];
  auto& target = update_target(index);
  const auto grad = gradient_for_update(index).to(torch::kFloat).reshape({-1});
  auto parameter = target.detach().to(torch::kFloat).reshape({-1});
  const auto s = step_scalars(options_.adamw, learning_rate_, step);
  const auto& [signed_map, unsigned_map] = dynamic_maps(target.device());
  constexpr int64_t blocksize = kOptimizerStateBlocksize;
  auto exp_avg = kernels::dequantize_blockwise_8bit(fields.at("state1"), fields.at("absmax1"), signed_map, blocksize)
                     .reshape({-1});
  auto exp_avg_sq =
      kernels::dequantize_blockwise_8bit(fields.at("state2"), fields.at("absmax2"), unsigned_map, blocksize)
          .reshape({-1});
  const auto finite = torch::isfinite(grad);
  exp_avg_sq = exp_avg_sq * s.beta2 + (grad * (1.0f - s.beta2)) * grad;
  exp_avg = exp_avg * s.beta1 + grad * (1.0f - s.beta1);
  exp_avg_sq = torch::where(finite, exp_avg_sq, torch::zeros_like(exp_avg_sq));
  exp_avg = torch::where(finite, exp_avg, torch::zeros_like(exp_avg));

  auto updated = parameter + (exp_avg / (exp_avg_sq.sqrt() + s.correction2 * s.eps)) * s.step_size;
  if (options_.adamw.weight_decay > 0.0) updated = updated * s.decay_factor;
  target.copy_(torch::where(finite, updated, parameter).view(target.sizes()));

  auto first = kernels::quantize_blockwise_8bit(exp_avg, signed_map, blocksize);
  auto second = kernels::quantize_blockwise_8bit(exp_avg_sq, unsigned_map, blocksize);
  // A code of the other sign than the moment moves one step towards the moment's sign.
  const auto code_values = signed_map.index_select(0, first.codes.to(torch::kLong));
  const auto flipped = torch::signbit(code_values) != torch::signbit(exp_avg);
  const auto nudge = torch::where(exp_avg > 0, torch::ones_like(first.codes, torch::kInt),
                                  torch::full_like(first.codes, -1, torch::kInt));
  const auto codes = torch::where(flipped, (first.codes.to(torch::kInt) + nudge).to(torch::kUInt8), first.codes);
  fields.at("state1").copy_(codes.view(target.sizes()));
  fields.at("absmax1").copy_(first.absmax);
  fields.at("state2").copy_(second.codes.view(target.sizes()));
  fields.at("absmax2").copy_(second.absmax);
}

void AdamW8bit::step_32bit(size_t index, int64_t step) {
  auto& fields = parameter_state_[index];
  auto& target = update_target(index);
  const auto grad = gradient_for_update(index).to(torch::kFloat);
  auto& exp_avg = fields.at("exp_avg");
  auto& exp_avg_sq = fields.at("exp_avg_sq");
  const auto s = step_scalars(options_.adamw, learning_rate_, step);
  exp_avg.mul_(s.beta1).add_(grad * (1.0f - s.beta1));
  exp_avg_sq.mul_(s.beta2).add_((grad * grad) * (1.0f - s.beta2));
  auto updated = target.to(torch::kFloat) + (exp_avg / (exp_avg_sq.sqrt() + s.eps * s.correction2)) * s.step_size;
  if (options_.adamw.weight_decay > 0.0) updated = updated * s.decay_factor;
  target.copy_(updated);
}

}  // namespace qtrain::optim
