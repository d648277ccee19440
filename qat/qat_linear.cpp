#include "qat/qat_linear.h"

#include <utility>

#include "kernels/error.h"
#include "qat/adapter_switch.h"

namespace qtrain::qat {

QatLinear::QatLinear(std::shared_ptr<LinearLayer> inner, const QatLinearOptions& options, const std::string& what)
    : inner_(std::move(inner)), lora_gradient_(options.lora_gradient) {
  if (!inner_) throw Error(ErrorCode::kInternal, "QatLinear needs a layer to quantize, got none");
  if (const auto* lora = dynamic_cast<const LoraLinear*>(inner_.get()); lora && lora->options().dropout > 0.0) {
    throw Error(ErrorCode::kRecipe, "LoRA dropout " + std::to_string(lora->options().dropout) + " cannot apply under " + what +
                ", which fake-quantizes the merged weight W + scale * B A (dropout acts on the LoRA branch's input, "
                "which the merged weight has no place for); give the adapters no dropout");
  }
  // The inner layer's state under its own names (see the header), shared, not copied.
  for (const auto& item : inner_->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : inner_->named_buffers(/*recurse=*/false)) register_buffer(item.key(), item.value());
  for (const auto& item : inner_->named_children()) register_module(item.key(), item.value());

  // The weight's shape and device, without building it (a 4-bit base would be dequantized, a LoRA
  // merged, for nothing).
  weight_fake_quant_ = register_module(
      "weight_fake_quant",
      std::make_shared<FakeQuantizer>(options.weights, what + ".weights", std::vector<int64_t>{out_features(), in_features()}));
  if (options.activations) {
    activation_fake_quant_ =
        register_module("activation_fake_quant", std::make_shared<FakeQuantizer>(*options.activations, what + ".activations"));
  }
  if (auto lora = std::dynamic_pointer_cast<LoraLinear>(inner_); lora && fuses_merged_fake_quant(*lora, options.weights)) {
    fused_lora_ = std::move(lora);
  }
  // The quantizers' state lives where the weight does.
  const auto device = module_device(*inner_);
  weight_fake_quant_->to(device);
  if (activation_fake_quant_) activation_fake_quant_->to(device);
}

torch::Tensor QatLinear::forward(const torch::Tensor& input) {
  // Adapters off (qat/adapter_switch.h): the quantized base alone, through the unfused path.
  if (fused_lora_ && adapters_enabled()) {
    const auto quantized_input = activation_fake_quant_ ? activation_fake_quant_->forward(input) : input;
    if (!fake_quant_enabled()) return fused_lora_->forward(quantized_input);
    return qat_lora_matmul(quantized_input, fused_lora_, weight_fake_quant_->spec(), lora_gradient_);
  }
  const auto dtype = input.scalar_type();
  const auto weight = weight_fake_quant_->forward(inner_->dense_weight(torch::kFloat32));
  const auto quantized_input = activation_fake_quant_ ? activation_fake_quant_->forward(input) : input;
  auto bias = inner_->bias();
  if (bias.defined()) bias = bias.to(dtype);
  return torch::nn::functional::linear(quantized_input, weight.to(dtype), bias);
}

torch::Tensor QatLinear::dense_weight(torch::ScalarType dtype) const {
  if (!fake_quant_enabled()) return inner_->dense_weight(dtype);
  if (weight_fake_quant_->spec().is_gguf_block()) return dequantize_gguf_grid(convert_gguf_grid()).to(dtype);
  return convert().dequantize().to(dtype);
}

GgufGridTensor QatLinear::convert_gguf_grid() const {
  torch::NoGradGuard no_grad;
  return weight_fake_quant_->gguf_grid(inner_->dense_weight(torch::kFloat32));
}

QuantizedTensor QatLinear::convert() const {
  torch::NoGradGuard no_grad;
  if (weight_fake_quant_->spec().is_gguf_block()) {
    throw Error(ErrorCode::kInternal, weight_fake_quant_->what() + ".format: gguf weights (" + weight_fake_quant_->spec().describe() +
                ") have a GGUF block type's codes and scales: convert_gguf_grid gives them (internal error)");
  }
  if (fused_lora_) {
    return fake_quantize_merged(*fused_lora_, weight_fake_quant_->spec(), torch::kFloat32, false, true, false).quantized;
  }
  return weight_fake_quant_->quantize_tensor(inner_->dense_weight(torch::kFloat32));
}

void QatLinear::set_fake_quant_enabled(bool enabled) {
  weight_fake_quant_->set_fake_quant_enabled(enabled);
  if (activation_fake_quant_) activation_fake_quant_->set_fake_quant_enabled(enabled);
}

void QatLinear::set_observer_enabled(bool enabled) {
  weight_fake_quant_->set_observer_enabled(enabled);
  if (activation_fake_quant_) activation_fake_quant_->set_observer_enabled(enabled);
}

void QatLinear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::QatLinear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", weights=" << weight_fake_quant_->spec().describe();
  if (activation_fake_quant_) stream << ", activations=" << activation_fake_quant_->spec().describe();
  if (fused_lora_) stream << ", merged in one pass, lora_gradient=" << lora_gradient_name(lora_gradient_);
  stream << (fake_quant_enabled() ? "" : ", fake quant disabled") << ")";
}

std::vector<std::string> apply_qat(torch::nn::Module& root, const LoraTargets& targets, const QatLinearOptions& options,
                                   const std::string& what) {
  const auto is_qat = [](const LinearLayer& layer) { return dynamic_cast<const QatLinear*>(&layer) != nullptr; };
  const auto is_wrapper = [&](const LinearLayer& layer) {
    return is_qat(layer) || dynamic_cast<const LoraLinear*>(&layer) != nullptr;
  };
  const auto found = find_linear_layers(
      root, [&](const std::string& name, const LinearLayer& layer) { return !is_qat(layer) && targets.matches(name); },
      is_wrapper);
  if (found.empty()) {
    throw Error(ErrorCode::kRecipe, what + ".target_modules: no linear layer matches " + targets.include.describe() +
                " (module names look like 'model.layers.0.self_attn.q_proj')");
  }
  std::vector<std::string> wrapped;
  for (const auto& target : found) {
    auto layer_options = options;
    if (options.weight_spec_of) layer_options.weights.spec = options.weight_spec_of(target.name);
    auto layer = std::make_shared<QatLinear>(target.layer, layer_options, what);
    layer->train(target.layer->is_training());
    replace_linear_layer_at(root, target.name, layer);
    wrapped.push_back(target.name);
  }
  return wrapped;
}

std::vector<std::pair<std::string, std::shared_ptr<QatLinear>>> find_qat_layers(const torch::nn::Module& root) {
  std::vector<std::pair<std::string, std::shared_ptr<QatLinear>>> layers;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (auto layer = std::dynamic_pointer_cast<QatLinear>(item.value())) layers.emplace_back(item.key(), layer);
  }
  return layers;
}

void set_fake_quant_enabled(torch::nn::Module& root, bool enabled) {
  for (const auto& item : find_qat_layers(root)) item.second->set_fake_quant_enabled(enabled);
}

void set_observer_enabled(torch::nn::Module& root, bool enabled) {
  for (const auto& item : find_qat_layers(root)) item.second->set_observer_enabled(enabled);
}

bool quantizers_have_scales(const torch::nn::Module& root) {
  for (const auto& item : find_qat_layers(root)) {
    const auto& layer = *item.second;
    if (!layer.weight_fake_quant().has_scale()) return false;
    if (layer.activation_fake_quant() && !layer.activation_fake_quant()->has_scale()) return false;
  }
  return true;
}

}  // namespace qtrain::qat
