#include "optim/grad_clip.h"

#include <map>
#include <utility>

#include "kernels/error.h"

namespace qtrain::optim {

double clip_grad_norm(const std::vector<torch::Tensor>& parameters, double max_norm) {
  const auto norm = clip_grad_norm_on_device(parameters, max_norm);
  return norm.defined() ? norm.item<double>() : 0.0;
}

torch::Tensor clip_grad_norm_on_device(const std::vector<torch::Tensor>& parameters, double max_norm) {
  torch::NoGradGuard no_grad;
  // Gradients grouped by (device, dtype) so each group's norms come from one _foreach_norm
  // (one kernel on CUDA, per-tensor linalg_vector_norm on CPU, as torch's clip_grad_norm_).
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<torch::Tensor>> groups;
  for (const auto& parameter : parameters) {
    const auto& grad = parameter.grad();
    if (!grad.defined()) continue;
    if (grad.is_sparse()) throw Error(ErrorCode::kInternal, "clip_grad_norm: sparse gradients are not supported");
    groups[{grad.device().str(), grad.scalar_type()}].push_back(grad);
  }
  if (groups.empty()) return {};

  const auto first_device = groups.begin()->second.front().device();
  bool any_double = false;
  for (const auto& [key, grads] : groups) any_double = any_double || key.second == torch::kDouble;
  const auto accumulate = any_double ? torch::kDouble : torch::kFloat;
  std::vector<torch::Tensor> norms;
  for (const auto& [key, grads] : groups) {
    for (auto& norm : torch::_foreach_norm(grads, 2, accumulate)) norms.push_back(norm.to(first_device));
  }
  const auto total_norm = norms.size() == 1 ? norms.front() : torch::linalg_vector_norm(torch::stack(norms), 2);
  if (max_norm > 0.0) {
    const auto coefficient = torch::clamp(max_norm / (total_norm + 1e-6), std::nullopt, 1.0);
    for (auto& [key, grads] : groups) {
      torch::_foreach_mul_(grads, coefficient.to(grads.front().device()));
    }
  }
  return total_norm;
}

}  // namespace qtrain::optim
