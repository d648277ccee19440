#include "qat/four_bit_linear.h"

#include "kernels/error.h"
#include "qat/float8_matmul.h"
#include "qat/four_bit_matmul.h"

namespace qtrain::qat {

FourBitLinear::FourBitLinear(FourBitTensor weight, const torch::Tensor& bias, torch::ScalarType compute_dtype) {
  if (weight.state.shape.size() != 2) {
    throw Error(ErrorCode::kWeights, "FourBitLinear: the quantized weight must be 2-d [out, in], got " +
                std::to_string(weight.state.shape.size()) + " dimensions");
  }
  weight.state.check(weight.packed, "FourBitLinear");
  state_ = std::move(weight.state);
  packed_ = register_buffer("weight", weight.packed);
  state_.absmax = register_buffer("absmax", state_.absmax);
  state_.code = register_buffer("quant_map", state_.code);
  if (state_.double_quant()) {
    state_.nested_absmax = register_buffer("nested_absmax", state_.nested_absmax);
    state_.nested_code = register_buffer("nested_quant_map", state_.nested_code);
  }
  if (bias.defined()) {
    if (bias.numel() != out_features()) {
      throw Error(ErrorCode::kWeights, "FourBitLinear: bias has " + std::to_string(bias.numel()) + " values, the weight has " +
                  std::to_string(out_features()) + " rows");
    }
    bias_ = register_buffer("bias", bias.detach().to(packed_.device(), compute_dtype).clone());
  }
}

std::shared_ptr<FourBitLinear> FourBitLinear::from_dense(const torch::Tensor& weight, const torch::Tensor& bias,
                                                         const FourBitOptions& options) {
  if (weight.dim() != 2) throw Error(ErrorCode::kInternal, "FourBitLinear::from_dense: the weight must be 2-d [out, in]");
  const auto type = parse_four_bit_type(options.quant_type, "the 4-bit quant_type");
  return std::make_shared<FourBitLinear>(quantize_4bit(weight, type, options.blocksize, options.double_quant), bias,
                                         options.compute_dtype);
}

torch::Tensor FourBitLinear::forward(const torch::Tensor& input) {
  auto output = four_bit_matmul(input, packed_, state_);
  return bias_.defined() ? output + bias_.to(input.scalar_type()) : output;
}

torch::Tensor FourBitLinear::dense_weight(torch::ScalarType dtype) const {
  return dequantize_4bit(packed_, state_, dtype);
}

bool FourBitLinear::builds_weight_rows() const {
  return in_features() % state_.blocksize == 0 && state_.blocksize % 2 == 0;
}

torch::Tensor FourBitLinear::matmul_weight_rows(torch::ScalarType dtype, int64_t begin, int64_t end) const {
  if (!builds_weight_rows()) return LinearLayer::matmul_weight_rows(dtype, begin, end);
  const int64_t out = out_features(), in = in_features();
  if (begin < 0 || end > out || begin >= end) {
    throw Error(ErrorCode::kInternal, "rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of a 4-bit [" +
                                          std::to_string(out) + ", " + std::to_string(in) + "] weight are not rows of it");
  }
  const int64_t blocks_per_row = in / state_.blocksize;
  return dequantize_4bit_blocks(packed_, state_, begin * blocks_per_row, (end - begin) * blocks_per_row, dtype)
      .view({end - begin, in});
}

void FourBitLinear::multiply_on_float8(bool fast_accumulation) {
  if (in_features() % 16 != 0 || out_features() % 16 != 0) {
    throw Error(ErrorCode::kRecipe, "FP8 tensor cores take sizes in multiples of 16, and this 4-bit layer is [" +
                std::to_string(out_features()) + ", " + std::to_string(in_features()) + "]");
  }
  float8_ = true;
  fast_accumulation_ = fast_accumulation;
}

Float8Rows FourBitLinear::float8_weight() const {
  torch::NoGradGuard no_grad;
  if (!float8_scales_.defined() || float8_scales_.device() != packed_.device()) {
    // The bf16 weight's own row scales, as quantize_rows_float8 measures them (once per device).
    float8_scales_ = quantize_rows_float8(dense_weight(torch::kBFloat16)).scales;
  }
  return {dequantize_4bit_to_float8(packed_, state_, float8_scales_), float8_scales_};
}

torch::Tensor FourBitLinear::own_product(const torch::Tensor& rows, torch::Tensor onto) const {
  if (!float8_) return LinearLayer::own_product(rows, std::move(onto));
  const auto weight = float8_weight();
  kept_ = KeepBuiltWeights::active() ? weight : Float8Rows();
  return float8_product(rows, weight, fast_accumulation_, std::move(onto));
}

torch::Tensor FourBitLinear::own_input_gradient(const torch::Tensor& grad_rows, torch::Tensor onto) const {
  if (!float8_) return LinearLayer::own_input_gradient(grad_rows, std::move(onto));
  const auto weight = kept_.codes.defined() ? kept_ : float8_weight();
  kept_ = Float8Rows();
  return float8_input_gradient(grad_rows, weight, std::move(onto));
}

void FourBitLinear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::FourBitLinear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", quant_type=" << four_bit_type_name(state_.quant_type) << ", blocksize=" << state_.blocksize
         << ", double_quant=" << (state_.double_quant() ? "true" : "false") << ", bias=" << (bias_.defined() ? "true" : "false")
         << (float8_ ? ", fp8_compute=true" : "") << ")";
}

// Buffers share their tensors with the members and the quant state, and Module::to changes them
// in place (set_data), so a device move needs no bookkeeping here.
void FourBitLinear::to(torch::Dtype dtype, bool non_blocking) {
  if (bias_.defined()) bias_.set_data(bias_.to(dtype, non_blocking));
}

void FourBitLinear::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  to(dtype, non_blocking);
}

std::vector<std::string> quantize_linear_layers(torch::nn::Module& root, const FourBitOptions& options,
                                                const std::vector<std::string>& skip_modules) {
  parse_four_bit_type(options.quant_type, "the 4-bit quant_type");
  check_four_bit_blocksize(options.blocksize);
  return quantize_dense_linear_layers(root, skip_modules, options.device,
                                      [&](const torch::Tensor& weight, const torch::Tensor& bias) {
                                        return FourBitLinear::from_dense(weight, bias, options);
                                      });
}

}  // namespace qtrain::qat
