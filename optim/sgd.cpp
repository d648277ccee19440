#include "optim/sgd.h"

#include "kernels/error.h"

namespace qtrain::optim {

Sgd::Sgd(std::vector<torch::Tensor> parameters, const SgdOptions& options)
    : Optimizer(std::move(parameters), options.lr, "sgd"), options_(options) {
  if (!(options.momentum >= 0.0)) throw Error(ErrorCode::kRecipe, "optim.momentum must be >= 0, got " + std::to_string(options.momentum));
  if (!(options.weight_decay >= 0.0)) {
    throw Error(ErrorCode::kRecipe, "optim.weight_decay must be >= 0, got " + std::to_string(options.weight_decay));
  }
  if (options.nesterov && options.momentum <= 0.0) {
    throw Error(ErrorCode::kRecipe, "sgd optimizer: Nesterov momentum needs optim.momentum > 0");
  }
}

std::vector<std::string> Sgd::state_fields(size_t index) const {
  std::vector<std::string> fields;
  if (options_.momentum != 0.0) fields.emplace_back("momentum_buffer");
  if (needs_master(parameters_[index])) fields.emplace_back("master");
  return fields;
}

// torch::optim::SGD::step with dampening 0, op for op.
void Sgd::step() {
  torch::NoGradGuard no_grad;
  for (size_t index = 0; index < parameters_.size(); ++index) {
    if (!parameters_[index].grad().defined()) continue;
    auto direction = gradient_for_update(index);
    auto& target = update_target(index);
    if (options_.weight_decay != 0.0) direction = direction.add(target, options_.weight_decay);
    if (options_.momentum != 0.0) {
      auto& buffer = parameter_state_[index]["momentum_buffer"];
      if (!buffer.defined()) {
        buffer = torch::clone(direction).detach();
      } else {
        buffer.mul_(options_.momentum).add_(direction, 1);
      }
      direction = options_.nesterov ? direction.add(buffer, options_.momentum) : buffer;
    }
    target.add_(direction, -1 * learning_rate_);
    write_back_master(index);
  }
}

}  // namespace qtrain::optim
