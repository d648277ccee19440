#include "qat/fake_quant.h"

#include <cmath>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class StraightThroughFakeQuantize : public torch::autograd::Function<StraightThroughFakeQuantize> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& x, const QuantSpec& spec,
                               const QuantParams& params) {
    auto quantized = fake_quantize_values(spec, x, params);
    context->save_for_backward({quantized.inside});
    return quantized.values.to(x.scalar_type());
  }

  static variable_list backward(AutogradContext* context, variable_list grad_outputs) {
    const auto inside = context->get_saved_variables()[0];
    const auto& grad = grad_outputs[0];
    auto grad_x = (grad.reshape(inside.sizes()) * inside.to(grad.scalar_type())).reshape(grad.sizes());
    return {grad_x, torch::Tensor(), torch::Tensor()};
  }
};

class LearnedStepSizeFakeQuantize : public torch::autograd::Function<LearnedStepSizeFakeQuantize> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& x, const torch::Tensor& scale,
                               const torch::Tensor& zero_point, const QuantSpec& spec, double gradient_scale) {
    torch::NoGradGuard no_grad;
    const QuantParams params{effective_scale(spec, scale.detach()), zero_point.detach().to(torch::kFloat32)};
    auto quantized = fake_quantize_values(spec, x, params);

    // The paper's derivative with respect to s, per element, in the block view.
    const auto blocks = x.detach().to(torch::kFloat32).reshape(quantized.inside.sizes());
    const auto steps = blocks / params.scale.unsqueeze(-1);
    const auto zero = params.zero_point.unsqueeze(-1);
    const auto lowest = static_cast<double>(spec.quant_min()) - zero;  // -Qn
    const auto highest = static_cast<double>(spec.quant_max()) - zero;  // Qp
    const auto inside = (steps > lowest) & (steps < highest);
    const auto scale_derivative =
        torch::where(inside, torch::round(steps) - steps, torch::where(steps <= lowest, lowest, highest));
    context->save_for_backward({inside, scale_derivative});
    context->saved_data["gradient_scale"] = gradient_scale;
    context->saved_data["scale_dtype"] = static_cast<int64_t>(scale.scalar_type());
    return quantized.values.to(x.scalar_type());
  }

  static variable_list backward(AutogradContext* context, variable_list grad_outputs) {
    const auto saved = context->get_saved_variables();
    const auto& inside = saved[0];
    const auto& scale_derivative = saved[1];
    const auto& grad = grad_outputs[0];
    const auto grad_blocks = grad.to(torch::kFloat32).reshape(inside.sizes());
    auto grad_x = (grad_blocks * inside.to(torch::kFloat32)).reshape(grad.sizes()).to(grad.scalar_type());
    const double gradient_scale = context->saved_data["gradient_scale"].toDouble();
    const auto scale_dtype = static_cast<torch::ScalarType>(context->saved_data["scale_dtype"].toInt());
    auto grad_scale = ((grad_blocks * scale_derivative).sum(-1) * gradient_scale).to(scale_dtype);
    return {grad_x, grad_scale, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fake_quantize(const torch::Tensor& x, const QuantSpec& spec, const QuantParams& params) {
  return StraightThroughFakeQuantize::apply(x, spec, params);
}

torch::Tensor fake_quantize_learned_scale(const torch::Tensor& x, const torch::Tensor& scale,
                                          const torch::Tensor& zero_point, const QuantSpec& spec,
                                          double gradient_scale) {
  if (!spec.has_integer_zero_point()) {
    throw Error(ErrorCode::kRecipe, "learned scales (LSQ) need an int format with an integer zero point, got " + spec.describe());
  }
  return LearnedStepSizeFakeQuantize::apply(x, scale, zero_point, spec, gradient_scale);
}

double lsq_gradient_scale(const QuantSpec& spec, int64_t elements_per_scale) {
  const int64_t positive_end = spec.symmetric ? spec.quant_max() : spec.quant_max() - spec.quant_min();
  return 1.0 / std::sqrt(static_cast<double>(elements_per_scale) * static_cast<double>(positive_end));
}

}  // namespace qtrain::qat
