#include "qat/layer_replacement.h"

namespace qtrain::qat {

bool module_name_matches(const std::string& name, const std::vector<std::string>& entries) {
  for (const auto& entry : entries) {
    if (name == entry) return true;
    if (name.size() > entry.size() && name.compare(name.size() - entry.size(), entry.size(), entry) == 0 &&
        name[name.size() - entry.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

std::vector<std::string> replace_linear_layers(
    torch::nn::Module& root, const std::function<bool(const std::string&, const LinearLayer&)>& select,
    const std::function<std::shared_ptr<LinearLayer>(const LinearLayer&)>& make_layer) {
  const auto targets = find_linear_layers(root, select, [&](const LinearLayer& layer) { return select("", layer); });
  std::vector<std::string> replaced;
  torch::NoGradGuard no_grad;
  for (const auto& target : targets) {
    replace_linear_layer_at(root, target.name, make_layer(*target.layer));
    replaced.push_back(target.name);
  }
  return replaced;
}

std::vector<std::string> replace_dense_linear_layers(
    torch::nn::Module& root, const std::vector<std::string>& skip_modules,
    const std::function<std::shared_ptr<LinearLayer>(const DenseLinear&)>& make_layer) {
  return replace_linear_layers(
      root,
      [&](const std::string& name, const LinearLayer& layer) {
        return dynamic_cast<const DenseLinear*>(&layer) != nullptr && !module_name_matches(name, skip_modules);
      },
      [&](const LinearLayer& layer) { return make_layer(static_cast<const DenseLinear&>(layer)); });
}

std::vector<std::string> quantize_dense_linear_layers(
    torch::nn::Module& root, const std::vector<std::string>& skip_modules, const std::optional<torch::Device>& device,
    const std::function<std::shared_ptr<LinearLayer>(const torch::Tensor& weight, const torch::Tensor& bias)>& make_layer) {
  const auto on_device = [&device](const torch::Tensor& tensor) {
    return tensor.defined() && device ? tensor.to(*device) : tensor;
  };
  return replace_dense_linear_layers(root, skip_modules, [&](const DenseLinear& dense) {
    return make_layer(on_device(dense.weight()), on_device(dense.bias()));
  });
}

}  // namespace qtrain::qat
