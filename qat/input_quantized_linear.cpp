#include "qat/input_quantized_linear.h"

#include <utility>

#include "kernels/error.h"

namespace qtrain::qat {

InputQuantizedLinear::InputQuantizedLinear(std::shared_ptr<LinearLayer> inner, const FakeQuantizerOptions& activations,
                                           const std::string& what)
    : inner_(std::move(inner)) {
  if (!inner_) throw Error(ErrorCode::kInternal, "InputQuantizedLinear needs a layer, got none");
  for (const auto& item : inner_->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : inner_->named_buffers(/*recurse=*/false)) register_buffer(item.key(), item.value());
  for (const auto& item : inner_->named_children()) register_module(item.key(), item.value());
  activation_fake_quant_ = register_module("activation_fake_quant", std::make_shared<FakeQuantizer>(activations, what));
  activation_fake_quant_->to(inner_->dense_weight(torch::kFloat32).device());
}

torch::Tensor InputQuantizedLinear::forward(const torch::Tensor& input) {
  return inner_->forward(activation_fake_quant_->forward(input));
}

void InputQuantizedLinear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::InputQuantizedLinear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", activations=" << activation_fake_quant_->spec().describe() << ")";
}

}  // namespace qtrain::qat
