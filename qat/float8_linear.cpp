#include "qat/float8_linear.h"

#include "kernels/error.h"
#include "qat/float8_matmul.h"
#include "qat/layer_replacement.h"

namespace qtrain::qat {

Float8Linear::Float8Linear(Float8Rows weight, const torch::Tensor& bias, torch::ScalarType compute_dtype,
                           bool fast_accumulation)
    : fast_accumulation_(fast_accumulation) {
  const auto& codes = weight.codes;
  if (codes.dim() != 2 || codes.scalar_type() != torch::kFloat8_e4m3fn) {
    throw Error(ErrorCode::kWeights, "Float8Linear: the weight must be float8_e4m3fn [out, in]");
  }
  if (weight.scales.numel() != codes.size(0) || weight.scales.scalar_type() != torch::kFloat32) {
    throw Error(ErrorCode::kWeights, "Float8Linear: weight_scale must be fp32 with one value per row (" +
                std::to_string(codes.size(0)) + "), got " + std::to_string(weight.scales.numel()));
  }
  weight_.codes = register_buffer("weight", codes.detach().contiguous());
  weight_.scales = register_buffer("weight_scale", weight.scales.detach().to(codes.device()).reshape({-1, 1}).contiguous());
  if (bias.defined()) {
    if (bias.numel() != out_features()) {
      throw Error(ErrorCode::kWeights, "Float8Linear: bias has " + std::to_string(bias.numel()) + " values, the weight has " +
                  std::to_string(out_features()) + " rows");
    }
    bias_ = register_buffer("bias", bias.detach().to(codes.device(), compute_dtype).clone());
  }
}

std::shared_ptr<Float8Linear> Float8Linear::from_dense(const torch::Tensor& weight, const torch::Tensor& bias,
                                                       const Float8Options& options) {
  if (weight.dim() != 2) throw Error(ErrorCode::kInternal, "Float8Linear::from_dense: the weight must be 2-d [out, in]");
  auto layer = std::make_shared<Float8Linear>(quantize_rows_float8(weight.detach()), bias, options.compute_dtype,
                                              options.fast_accumulation);
  if (options.keep_dense_weight_on_host) layer->dense_on_host_ = weight.detach().to(torch::kCPU, options.compute_dtype);
  return layer;
}

torch::Tensor Float8Linear::dense_weight(torch::ScalarType dtype) const {
  if (dense_on_host_.defined()) return dense_on_host_.to(weight_.codes.device(), dtype);
  return dequantize_rows_float8(weight_, dtype);
}

torch::Tensor Float8Linear::forward(const torch::Tensor& input) {
  auto output = float8_matmul(input, weight_, fast_accumulation_);
  return bias_.defined() ? output + bias_.to(input.scalar_type()) : output;
}

torch::Tensor Float8Linear::own_product(const torch::Tensor& rows, torch::Tensor onto) const {
  return float8_product(rows, weight_, fast_accumulation_, std::move(onto));
}

torch::Tensor Float8Linear::own_input_gradient(const torch::Tensor& grad_rows, torch::Tensor onto) const {
  return float8_input_gradient(grad_rows, weight_, std::move(onto));
}

void Float8Linear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::Float8Linear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", format=e4m3, scale=per row, fast_accumulation=" << (fast_accumulation_ ? "true" : "false")
         << ", bias=" << (bias_.defined() ? "true" : "false") << (dense_on_host_.defined() ? ", dense weight on the host" : "")
         << ")";
}

// Buffers share their tensors with the members, and Module::to changes them in place (set_data).
void Float8Linear::to(torch::Dtype dtype, bool non_blocking) {
  if (bias_.defined()) bias_.set_data(bias_.to(dtype, non_blocking));
}

void Float8Linear::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  to(dtype, non_blocking);
}

std::vector<std::string> quantize_linear_layers_float8(torch::nn::Module& root, const Float8Options& options,
                                                       const std::vector<std::string>& skip_modules) {
  return quantize_dense_linear_layers(root, skip_modules, options.device,
                                      [&](const torch::Tensor& weight, const torch::Tensor& bias) {
                                        return Float8Linear::from_dense(weight, bias, options);
                                      });
}

}  // namespace qtrain::qat
