#include "optim/optimizer.h"

#include <algorithm>
#include <sstream>

#include "kernels/error.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/sgd.h"

namespace qtrain::optim {
namespace {

// "12.exp_avg" -> {12, "exp_avg"}; throws for anything else.
std::pair<size_t, std::string> split_state_name(const std::string& name, const std::string& optimizer,
                                                size_t parameter_count) {
  const size_t dot = name.find('.');
  const std::string index_text = name.substr(0, dot);
  const bool numeric = !index_text.empty() && index_text.find_first_not_of("0123456789") == std::string::npos;
  if (dot == std::string::npos || !numeric || dot + 1 == name.size()) {
    throw Error(ErrorCode::kCheckpoint, optimizer + " optimizer state: entry '" + name +
                "' is not named '<parameter index>.<field>'; the checkpoint was not written by this optimizer");
  }
  const size_t index = std::stoul(index_text);
  if (index >= parameter_count) {
    throw Error(ErrorCode::kCheckpoint, optimizer + " optimizer state: entry '" + name + "' is for parameter " + index_text + ", but only " +
                std::to_string(parameter_count) +
                " parameters are trained; the checkpoint comes from a run with other trainable parameters");
  }
  return {index, name.substr(dot + 1)};
}

}  // namespace

Optimizer::Optimizer(std::vector<torch::Tensor> parameters, double learning_rate, const std::string& name)
    : parameters_(std::move(parameters)), parameter_state_(parameters_.size()), name_(name) {
  for (size_t index = 0; index < parameters_.size(); ++index) {
    const auto& parameter = parameters_[index];
    if (!parameter.defined()) throw Error(ErrorCode::kInternal, name_ + " optimizer: parameter " + std::to_string(index) + " is undefined");
    if (!parameter.is_floating_point()) {
      throw Error(ErrorCode::kInternal, name_ + " optimizer: parameter " + std::to_string(index) + " has dtype " +
                  std::string(c10::toString(parameter.scalar_type())) +
                  "; only floating-point tensors (fp32, fp64, bf16, fp16) can be trained");
    }
  }
  set_learning_rate(learning_rate);
}

void Optimizer::zero_grad() {
  for (auto& parameter : parameters_) {
    if (parameter.grad().defined()) parameter.mutable_grad().reset();
  }
}

void Optimizer::set_learning_rate(double lr) {
  if (!(lr >= 0.0)) throw Error(ErrorCode::kRecipe, "optim.lr must be >= 0, got " + std::to_string(lr));
  learning_rate_ = lr;
}

bool Optimizer::needs_master(const torch::Tensor& parameter) {
  return parameter.scalar_type() == torch::kBFloat16 || parameter.scalar_type() == torch::kHalf;
}

torch::Tensor& Optimizer::update_target(size_t index) {
  auto& parameter = parameters_[index];
  if (!needs_master(parameter)) return parameter;
  auto& master = parameter_state_[index]["master"];
  if (!master.defined()) master = parameter.detach().to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
  return master;
}

void Optimizer::write_back_master(size_t index) {
  if (!needs_master(parameters_[index])) return;
  torch::NoGradGuard no_grad;
  parameters_[index].copy_(parameter_state_[index].at("master"));
}

torch::Tensor Optimizer::gradient_for_update(size_t index) const {
  const auto& parameter = parameters_[index];
  const auto& grad = parameter.grad();
  if (grad.is_sparse()) {
    throw Error(ErrorCode::kInternal, name_ + " optimizer: parameter " + std::to_string(index) + " has a sparse gradient, which is not supported");
  }
  return needs_master(parameter) ? grad.to(torch::kFloat) : grad;
}

Optimizer::StateTensorSpec Optimizer::state_tensor_spec(size_t index, const std::string& field) const {
  const auto& parameter = parameters_[index];
  if (field == "step") return {{}, torch::kFloat};
  return {parameter.sizes().vec(), needs_master(parameter) ? torch::kFloat : parameter.scalar_type()};
}

NamedTensors Optimizer::state() const {
  NamedTensors named;
  // The slots only read here: one walk over the fields for both.
  for (const auto& [name, slot] : const_cast<Optimizer*>(this)->state_slots()) named.emplace_back(name, *slot);
  return named;
}

std::vector<std::pair<std::string, torch::Tensor*>> Optimizer::state_slots() {
  std::vector<size_t> every(parameters_.size());
  for (size_t index = 0; index < every.size(); ++index) every[index] = index;
  return state_slots(every);
}

std::vector<std::pair<std::string, torch::Tensor*>> Optimizer::state_slots(const std::vector<size_t>& indices) {
  std::vector<std::pair<std::string, torch::Tensor*>> slots;
  for (const size_t index : indices) {
    if (index >= parameters_.size()) throw Error(ErrorCode::kInternal, name_ + " optimizer: no parameter " + std::to_string(index));
    auto& fields = parameter_state_[index];
    if (fields.empty()) continue;
    for (const auto& field : state_fields(index)) slots.emplace_back(std::to_string(index) + "." + field, &fields.at(field));
  }
  return slots;
}

void Optimizer::load_state(const NamedTensors& state) {
  std::vector<std::map<std::string, torch::Tensor>> loaded(parameters_.size());
  for (const auto& [name, tensor] : state) {
    const auto [index, field] = split_state_name(name, name_, parameters_.size());
    const auto expected = state_fields(index);
    if (std::find(expected.begin(), expected.end(), field) == expected.end()) {
      throw Error(ErrorCode::kCheckpoint, name_ + " optimizer state: entry '" + name + "' has unknown field '" + field +
                  "'; the checkpoint was written by another optimizer or for a parameter of another dtype");
    }
    const auto& parameter = parameters_[index];
    const auto spec = state_tensor_spec(index, field);
    const bool scalar = spec.sizes.empty();
    if (!tensor.defined() || (scalar ? tensor.numel() != 1 : tensor.sizes() != c10::IntArrayRef(spec.sizes))) {
      throw Error(ErrorCode::kCheckpoint, name_ + " optimizer state: entry '" + name + "' has shape " +
                  (tensor.defined() ? shape_text(tensor.sizes()) : std::string("(undefined)")) + ", expected " +
                  (scalar ? std::string("one value") : shape_text(spec.sizes)) + " for parameter " +
                  std::to_string(index) + " " + shape_text(parameter.sizes()));
    }
    // Floating-point state may change precision on load; codes (uint8) must stay what they are.
    const bool floating = c10::isFloatingType(spec.dtype);
    if (floating ? !tensor.is_floating_point() : tensor.scalar_type() != spec.dtype) {
      throw Error(ErrorCode::kCheckpoint, name_ + " optimizer state: entry '" + name + "' has dtype " +
                  std::string(c10::toString(tensor.scalar_type())) + ", expected " +
                  std::string(c10::toString(spec.dtype)));
    }
    auto copy = tensor.detach().to(parameter.device(), spec.dtype, /*non_blocking=*/false, /*copy=*/true);
    loaded[index][field] = scalar ? copy.reshape({}) : copy;
  }
  for (size_t index = 0; index < parameters_.size(); ++index) {
    if (loaded[index].empty()) continue;
    for (const auto& field : state_fields(index)) {
      if (!loaded[index].count(field)) {
        throw Error(ErrorCode::kCheckpoint, name_ + " optimizer state: parameter " + std::to_string(index) + " has some state but no '" +
                    std::to_string(index) + "." + field + "' entry; the checkpoint is incomplete");
      }
    }
  }
  parameter_state_ = std::move(loaded);
  for (size_t index = 0; index < parameters_.size(); ++index) {
    if (!parameter_state_[index].empty()) write_back_master(index);
  }
}

std::unique_ptr<Optimizer> make_optimizer(const std::string& name, std::vector<torch::Tensor> parameters, double lr,
                                          double weight_decay, const std::array<double, 2>& betas, double eps,
                                          double momentum) {
  if (name == "adamw" || name == "adamw8bit") {
    AdamWOptions options;
    options.lr = lr;
    options.beta1 = betas[0];
    options.beta2 = betas[1];
    options.eps = eps;
    options.weight_decay = weight_decay;
    if (name == "adamw8bit") return std::make_unique<AdamW8bit>(std::move(parameters), AdamW8bitOptions{options});
    return std::make_unique<AdamW>(std::move(parameters), options);
  }
  if (name == "sgd") {
    SgdOptions options;
    options.lr = lr;
    options.momentum = momentum;
    options.weight_decay = weight_decay;
    return std::make_unique<Sgd>(std::move(parameters), options);
  }
  throw Error(ErrorCode::kRecipe, "optim.name '" + name + "' is unknown; use adamw, adamw8bit or sgd");
}

}  // namespace qtrain::optim
