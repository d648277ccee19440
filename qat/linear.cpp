#include "qat/linear.h"

namespace qtrain::qat {

DenseLinear::DenseLinear(const DenseLinearOptions& options) {
  auto tensor_options = torch::TensorOptions().dtype(options.dtype);
  weight_ = register_parameter("weight",
                               torch::empty({options.out_features, options.in_features}, tensor_options));
  // Same initialisation as torch.nn.Linear, for models built without a checkpoint.
  torch::nn::init::kaiming_uniform_(weight_, std::sqrt(5.0));
  if (options.bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features));
    bias_ = register_parameter("bias", torch::empty({options.out_features}, tensor_options).uniform_(-bound, bound));
  }
}

torch::Tensor DenseLinear::forward(const torch::Tensor& input) {
  return torch::nn::functional::linear(input, weight_, bias_);
}

void replace_linear_layer(torch::nn::Module& parent, const std::string& child_name,
                          std::shared_ptr<LinearLayer> layer) {
  if (auto* owner = dynamic_cast<LinearLayerOwner*>(&parent)) {
    owner->replace_linear(child_name, std::move(layer));
  } else {
    parent.replace_module(child_name, std::move(layer));
  }
}

}  // namespace qtrain::qat
