#include "trainer/model/router_loss.h"

#include "trainer/model/activation_checkpoint.h"

namespace qtrain::trainer {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The identity on a router's probabilities whose backward adds the load-balancing loss's share.
struct AddRouterLossGradient : public torch::autograd::Function<AddRouterLossGradient> {
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& probabilities, const RouterLoss* loss) {
    context->saved_data["loss"] = reinterpret_cast<int64_t>(loss);
    return probabilities.view_as(probabilities);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    const auto* loss = reinterpret_cast<const RouterLoss*>(context->saved_data["loss"].toInt());
    auto gradient = gradients[0];
    const auto share = loss->probability_gradient();
    if (share.defined()) gradient = gradient + share.to(gradient.device()).unsqueeze(0);
    return {gradient, torch::Tensor()};
  }
};

}  // namespace

void RouterLoss::begin() {
  counts_ = probabilities_ = torch::Tensor();
  rows_ = 0;
}

torch::Tensor RouterLoss::observe(const torch::Tensor& probabilities, const torch::Tensor& chosen) {
  if (!recomputing()) {
    torch::NoGradGuard no_grad;
    const auto flat = chosen.reshape(-1);
    const auto counts = torch::zeros({experts_}, probabilities.options()).index_add_(0, flat, torch::ones_like(flat, probabilities.options()));
    const auto sums = probabilities.detach().sum(0);
    counts_ = counts_.defined() ? counts_ + counts : counts;
    probabilities_ = probabilities_.defined() ? probabilities_ + sums : sums;
    rows_ += static_cast<double>(probabilities.size(0));
  }
  if (!torch::GradMode::is_enabled() || !probabilities.requires_grad()) return probabilities;
  return AddRouterLossGradient::apply(probabilities, this);
}

torch::Tensor RouterLoss::aux() const {
  if (rows_ == 0) return torch::Tensor();
  return (counts_ * probabilities_).sum().to(torch::kFloat64) * (static_cast<double>(experts_) / (rows_ * rows_));
}

double RouterLoss::value() const {
  const auto loss = aux();
  return loss.defined() ? loss.item<double>() : 0;
}

torch::Tensor RouterLoss::probability_gradient() const {
  if (rows_ == 0 || gradient_scale_ == 0) return torch::Tensor();
  return counts_ * (gradient_scale_ * static_cast<double>(experts_) / (rows_ * rows_));
}

}  // namespace qtrain::trainer
