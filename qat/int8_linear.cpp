#include "qat/int8_linear.h"

#include <optional>

#include "kernels/error.h"
#include "qat/int8_codec.h"

namespace qtrain::qat {

namespace {

// y = int8_mixed_matmul(x, W) + b forward; dx = dy dequantize(W) backward. The codes, absmax and
// bias are constants of the graph (no gradient).
class Int8MatmulFunction : public torch::autograd::Function<Int8MatmulFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& input,
                               const torch::Tensor& codes, const torch::Tensor& absmax,
                               const std::optional<torch::Tensor>& bias, double threshold) {
    context->saved_data["codes"] = codes;
    context->saved_data["absmax"] = absmax;
    context->saved_data["input_shape"] = input.sizes().vec();
    context->saved_data["input_dtype"] = static_cast<int64_t>(input.scalar_type());
    return int8_mixed_matmul(input, codes, absmax, bias.value_or(torch::Tensor()), threshold);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto dtype = static_cast<torch::ScalarType>(context->saved_data["input_dtype"].toInt());
    const auto weight = int8_vectorwise_dequantize(context->saved_data["codes"].toTensor(),
                                                   context->saved_data["absmax"].toTensor())
                            .to(dtype);
    const auto& grad_output = grad_outputs[0];
    auto grad_input = grad_output.to(dtype).reshape({-1, weight.size(0)}).mm(weight);
    grad_input = grad_input.view(context->saved_data["input_shape"].toIntVector());
    return {grad_input, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

Int8Linear::Int8Linear(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& bias,
                       double threshold, torch::ScalarType compute_dtype, const std::string& what)
    : threshold_(threshold) {
  if (!(threshold >= 0.0)) {
    throw Error(ErrorCode::kRecipe, what + ": the LLM.int8 threshold must be >= 0 (0 turns the outlier decomposition off), got " +
                std::to_string(threshold));
  }
  if (!codes.defined() || codes.scalar_type() != torch::kChar || codes.dim() != 2) {
    throw Error(ErrorCode::kWeights, what + ": the weight must be an int8 [out_features, in_features] tensor, got " +
                (codes.defined() ? std::string(c10::toString(codes.scalar_type())) + " " + shape_text(codes.sizes())
                                 : std::string("nothing")));
  }
  if (!absmax.defined() || absmax.numel() != codes.size(0) || !absmax.is_floating_point()) {
    throw Error(ErrorCode::kWeights, what + ": SCB must hold one fp32 absmax per weight row: " + std::to_string(codes.size(0)) +
                " for the weight " + shape_text(codes.sizes()) + ", got " +
                (absmax.defined() ? shape_text(absmax.sizes()) : std::string("nothing")));
  }
  codes_ = register_buffer("weight", codes.detach().contiguous());
  absmax_ = register_buffer("SCB", absmax.detach().to(codes.device(), torch::kFloat).reshape({-1}).contiguous());
  if (bias.defined()) {
    if (bias.numel() != out_features()) {
      throw Error(ErrorCode::kWeights, what + ": bias has " + std::to_string(bias.numel()) + " values, the weight has " +
                  std::to_string(out_features()) + " rows");
    }
    bias_ = register_buffer("bias", bias.detach().to(codes.device(), compute_dtype).clone());
  }
}

std::shared_ptr<Int8Linear> Int8Linear::from_dense(const torch::Tensor& weight, const torch::Tensor& bias,
                                                   const Int8Options& options) {
  if (weight.dim() != 2) throw Error(ErrorCode::kInternal, "Int8Linear::from_dense: the weight must be 2-d [out, in]");
  auto quantized = int8_vectorwise_quantize(weight, /*threshold=*/0.0);
  return std::make_shared<Int8Linear>(quantized.codes, quantized.absmax, bias, options.threshold,
                                      options.compute_dtype);
}

torch::Tensor Int8Linear::forward(const torch::Tensor& input) {
  // An undefined tensor cannot pass through a custom autograd function; an empty optional can.
  const std::optional<torch::Tensor> bias = bias_.defined() ? std::optional<torch::Tensor>(bias_) : std::nullopt;
  return Int8MatmulFunction::apply(input, codes_, absmax_, bias, threshold_);
}

torch::Tensor Int8Linear::dense_weight(torch::ScalarType dtype) const {
  return int8_vectorwise_dequantize(codes_, absmax_).to(dtype);
}

void Int8Linear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::Int8Linear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", threshold=" << threshold_ << ", bias=" << (bias_.defined() ? "true" : "false") << ")";
}

void Int8Linear::to(torch::Dtype dtype, bool non_blocking) {
  if (bias_.defined()) bias_.set_data(bias_.to(dtype, non_blocking));
}

void Int8Linear::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  to(dtype, non_blocking);
}

std::vector<std::string> quantize_linear_layers_int8(torch::nn::Module& root, const Int8Options& options,
                                                     const std::vector<std::string>& skip_modules) {
  if (!(options.threshold >= 0.0)) {
    throw Error(ErrorCode::kRecipe, "the LLM.int8 outlier threshold must be >= 0 (0 turns the outlier decomposition off), got " +
                std::to_string(options.threshold));
  }
  return quantize_dense_linear_layers(root, skip_modules, options.device,
                                      [&](const torch::Tensor& weight, const torch::Tensor& bias) {
                                        return Int8Linear::from_dense(weight, bias, options);
                                      });
}

}  // namespace qtrain::qat
