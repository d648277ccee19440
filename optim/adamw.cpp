#include "optim/adamw.h"

#include <cmath>

#include "kernels/error.h"

namespace qtrain::optim {

void check_adamw_options(const AdamWOptions& options) {
  if (!(options.beta1 >= 0.0 && options.beta1 < 1.0) || !(options.beta2 >= 0.0 && options.beta2 < 1.0)) {
    throw Error(ErrorCode::kRecipe, "optim.betas must both lie in [0, 1), got [" + std::to_string(options.beta1) + ", " +
                std::to_string(options.beta2) + "]");
  }
  // eps > 0, as the recipe's optim.eps allows: with 0, a parameter whose gradients are all zero
  // divides 0 by 0.
  if (!(options.eps > 0.0)) throw Error(ErrorCode::kRecipe, "optim.eps must be > 0, got " + std::to_string(options.eps));
  if (!(options.weight_decay >= 0.0)) {
    throw Error(ErrorCode::kRecipe, "optim.weight_decay must be >= 0, got " + std::to_string(options.weight_decay));
  }
}

AdamW::AdamW(std::vector<torch::Tensor> parameters, const AdamWOptions& options)
    : Optimizer(std::move(parameters), options.lr, "adamw"), options_(options) {
  check_adamw_options(options);
}

std::vector<std::string> AdamW::state_fields(size_t index) const {
  std::vector<std::string> fields{"step", "exp_avg", "exp_avg_sq"};
  if (needs_master(parameters_[index])) fields.emplace_back("master");
  return fields;
}

void AdamW::initialise_state(size_t index) {
  auto& fields = parameter_state_[index];
  if (!fields.empty()) return;
  const auto& target = update_target(index);
  fields["step"] = torch::zeros({}, target.options().dtype(torch::kFloat));
  fields["exp_avg"] = torch::zeros_like(target, torch::MemoryFormat::Preserve);
  fields["exp_avg_sq"] = torch::zeros_like(target, torch::MemoryFormat::Preserve);
}

void AdamW::step() {
  torch::NoGradGuard no_grad;
  // Parameters for the fused kernel, grouped by CUDA device index.
  std::map<int, std::vector<size_t>> fused_groups;
  for (size_t index = 0; index < parameters_.size(); ++index) {
    const auto& parameter = parameters_[index];
    const auto& grad = parameter.grad();
    if (!grad.defined()) continue;
    initialise_state(index);
    const bool fusable = parameter.is_cuda() && parameter.is_non_overlapping_and_dense() && !grad.is_sparse() &&
                         grad.is_non_overlapping_and_dense() && grad.strides() == parameter.strides();
    if (fusable) {
      fused_groups[parameter.get_device()].push_back(index);
    } else {
      step_reference(index);
    }
  }
  for (const auto& [device, indices] : fused_groups) step_fused(indices);
}

// torch::optim::AdamW::step, op for op, so the CPU result is bitwise PyTorch's C++ AdamW.
void AdamW::step_reference(size_t index) {
  const auto grad = gradient_for_update(index);
  auto& target = update_target(index);
  auto& fields = parameter_state_[index];
  auto& exp_avg = fields.at("exp_avg");
  auto& exp_avg_sq = fields.at("exp_avg_sq");
  auto& step = fields.at("step");
  const double lr = learning_rate_;

  if (options_.weight_decay != 0.0) target.mul_(1 - lr * options_.weight_decay);

  step.add_(1);
  const double step_count = step.item<double>();
  const double bias_correction1 = 1 - std::pow(options_.beta1, step_count);
  const double bias_correction2 = 1 - std::pow(options_.beta2, step_count);

  exp_avg.mul_(options_.beta1).add_(grad, 1 - options_.beta1);
  exp_avg_sq.mul_(options_.beta2).addcmul_(grad, grad, 1 - options_.beta2);

  const auto denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options_.eps);
  const double step_size = lr / bias_correction1;
  target.addcdiv_(exp_avg, denom, -step_size);
  write_back_master(index);
}

void AdamW::step_fused(const std::vector<size_t>& indices) {
  std::vector<torch::Tensor> targets, grads, exp_avgs, exp_avg_sqs, steps;
  for (const size_t index : indices) {
    grads.push_back(gradient_for_update(index));
    targets.push_back(update_target(index));
    auto& fields = parameter_state_[index];
    exp_avgs.push_back(fields.at("exp_avg"));
    exp_avg_sqs.push_back(fields.at("exp_avg_sq"));
    steps.push_back(fields.at("step"));
  }
  // As torch.optim.AdamW(fused=True): the kernel reads the already incremented step counters.
  torch::_foreach_add_(steps, 1);
  at::_fused_adamw_(targets, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, learning_rate_,
                    options_.beta1, options_.beta2, options_.weight_decay, options_.eps, /*amsgrad=*/false,
                    /*maximize=*/false);
  for (const size_t index : indices) write_back_master(index);
}

}  // namespace qtrain::optim
