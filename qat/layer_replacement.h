#pragma once
// Swapping a model's dense linear layers for quantized ones (a frozen 4-bit or LLM.int8 base),
// skipping modules by name as bitsandbytes' llm_int8_skip_modules does.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/linear.h"

namespace qtrain::qat {

// True when `name` equals an entry or ends in "." + entry.
bool module_name_matches(const std::string& name, const std::vector<std::string>& entries);

// Replaces every linear layer under `root` that `select` accepts (without looking inside it) by
// make_layer(layer), one at a time, so only one layer exists twice at a time. Returns the replaced
// names, in module order.
std::vector<std::string> replace_linear_layers(
    torch::nn::Module& root, const std::function<bool(const std::string&, const LinearLayer&)>& select,
    const std::function<std::shared_ptr<LinearLayer>(const LinearLayer&)>& make_layer);

// Replaces every DenseLinear under `root` whose dotted name does not match `skip_modules` by
// make_layer(dense), one at a time through replace_linear_layer (so only one layer exists twice at
// a time). Returns the replaced names, in module order.
std::vector<std::string> replace_dense_linear_layers(
    torch::nn::Module& root, const std::vector<std::string>& skip_modules,
    const std::function<std::shared_ptr<LinearLayer>(const DenseLinear&)>& make_layer);

// replace_dense_linear_layers for a quantizer: make_layer(weight, bias) gets each dense layer's
// weight and bias (undefined when it has none) moved to `device` first, where one is given, so a
// model loaded on the host is quantized on the GPU one layer at a time.
std::vector<std::string> quantize_dense_linear_layers(
    torch::nn::Module& root, const std::vector<std::string>& skip_modules, const std::optional<torch::Device>& device,
    const std::function<std::shared_ptr<LinearLayer>(const torch::Tensor& weight, const torch::Tensor& bias)>& make_layer);

}  // namespace qtrain::qat
