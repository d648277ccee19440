#include "qat/linear.h"

#include <utility>

#include "kernels/error.h"

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

torch::Tensor LinearLayer::matmul_weight(torch::ScalarType) const {
  throw Error(ErrorCode::kInternal, name() + " does not multiply by a dense weight; its adapters run unfused (a bug if reached)");
}

torch::Tensor LinearLayer::matmul_weight_rows(torch::ScalarType, int64_t, int64_t) const {
  throw Error(ErrorCode::kInternal, name() + " builds only its whole weight, not rows of it (a bug if reached)");
}

torch::Tensor LinearLayer::own_product(const torch::Tensor&, torch::Tensor) const {
  throw Error(ErrorCode::kInternal, name() + " multiplies through its weight, not its own product (a bug if reached)");
}

torch::Tensor LinearLayer::own_input_gradient(const torch::Tensor&, torch::Tensor) const {
  throw Error(ErrorCode::kInternal, name() + " multiplies through its weight, not its own product (a bug if reached)");
}

void replace_linear_layer(torch::nn::Module& parent, const std::string& child_name,
                          std::shared_ptr<LinearLayer> layer) {
  if (auto* owner = dynamic_cast<LinearLayerOwner*>(&parent)) {
    owner->replace_linear(child_name, std::move(layer));
  } else {
    parent.replace_module(child_name, std::move(layer));
  }
}

torch::Device module_device(const torch::nn::Module& module) {
  for (const auto& parameter : module.parameters()) return parameter.device();
  for (const auto& buffer : module.buffers()) return buffer.device();
  return torch::kCPU;
}

void replace_linear_layer_at(torch::nn::Module& root, const std::string& name, std::shared_ptr<LinearLayer> layer) {
  const auto dot = name.rfind('.');
  if (dot == std::string::npos) return replace_linear_layer(root, name, std::move(layer));
  const std::string parent_name = name.substr(0, dot);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (item.key() == parent_name) return replace_linear_layer(*item.value(), name.substr(dot + 1), std::move(layer));
  }
  throw Error(ErrorCode::kInternal, "no module '" + parent_name + "' to replace '" + name + "' in (internal error)");
}

std::vector<NamedLinearLayer> find_linear_layers(
    const torch::nn::Module& root, const std::function<bool(const std::string&, const LinearLayer&)>& select,
    const std::function<bool(const LinearLayer&)>& opaque) {
  std::vector<NamedLinearLayer> found;
  std::vector<std::string> opaque_prefixes;  // "<name>." of every opaque layer: its insides are skipped
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const std::string& name = item.key();
    bool inside_opaque = false;
    for (const auto& prefix : opaque_prefixes) inside_opaque |= name.compare(0, prefix.size(), prefix) == 0;
    if (inside_opaque) continue;
    auto layer = std::dynamic_pointer_cast<LinearLayer>(item.value());
    if (!layer) continue;
    if (select(name, *layer)) found.push_back({name, layer});
    if (opaque(*layer)) opaque_prefixes.push_back(name + ".");
  }
  return found;
}

}  // namespace qtrain::qat
