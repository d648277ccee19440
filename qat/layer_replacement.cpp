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

std::vector<std::string> replace_dense_linear_layers(
    torch::nn::Module& root, const std::vector<std::string>& skip_modules,
    const std::function<std::shared_ptr<LinearLayer>(const DenseLinear&)>& make_layer) {
  struct Target {
    std::string name;
    std::shared_ptr<DenseLinear> layer;
  };
  std::vector<Target> targets;
  for (const auto& item : root.named_modules()) {
    auto dense = std::dynamic_pointer_cast<DenseLinear>(item.value());
    if (dense && !item.key().empty() && !module_name_matches(item.key(), skip_modules)) {
      targets.push_back({item.key(), dense});
    }
  }
  const auto modules = root.named_modules();
  std::vector<std::string> replaced;
  torch::NoGradGuard no_grad;
  for (const auto& target : targets) {
    const auto dot = target.name.rfind('.');
    const std::string parent_name = dot == std::string::npos ? "" : target.name.substr(0, dot);
    const std::string child_name = dot == std::string::npos ? target.name : target.name.substr(dot + 1);
    torch::nn::Module& parent = parent_name.empty() ? root : *modules[parent_name];
    replace_linear_layer(parent, child_name, make_layer(*target.layer));
    replaced.push_back(target.name);
  }
  return replaced;
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
