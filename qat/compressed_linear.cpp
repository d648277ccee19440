#include "qat/compressed_linear.h"

#include "kernels/error.h"
#include "qat/float8_linear.h"
#include "qat/input_quantized_linear.h"
#include "qat/layer_replacement.h"

namespace qtrain::qat {

const char* CompressedLinear::data_name(CompressionFormat format) {
  const bool packed = format == CompressionFormat::kPackQuantized || format == CompressionFormat::kNvfp4PackQuantized;
  return packed ? "weight_packed" : "weight";
}

const char* CompressedLinear::scale_name(CompressionFormat format) {
  return format == CompressionFormat::kFp8Blocks ? "weight_scale_inv" : "weight_scale";
}

CompressedLinear::CompressedLinear(CompressedWeight weight, const torch::Tensor& bias, torch::ScalarType compute_dtype)
    : weight_(std::move(weight)) {
  weight_.data = register_buffer(data_name(weight_.format), weight_.data);
  weight_.scale = register_buffer(scale_name(weight_.format), weight_.scale);
  if (weight_.zero_point.defined()) weight_.zero_point = register_buffer("weight_zero_point", weight_.zero_point);
  if (weight_.global_scale.defined()) weight_.global_scale = register_buffer("weight_global_scale", weight_.global_scale);
  if (bias.defined()) {
    if (bias.numel() != out_features()) {
      throw Error(ErrorCode::kWeights, "CompressedLinear: bias has " + std::to_string(bias.numel()) + " values, the weight has " +
                  std::to_string(out_features()) + " rows");
    }
    const auto device = weight_.data.device();
    bias_ = register_buffer("bias", bias.detach().to(device, compute_dtype).clone());
  }
}

torch::Tensor CompressedLinear::forward(const torch::Tensor& input) {
  const auto weight = weight_.dequantize(input.scalar_type());
  return torch::nn::functional::linear(input, weight, bias_.defined() ? bias_.to(input.scalar_type()) : torch::Tensor());
}

void CompressedLinear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::CompressedLinear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", format=" << compression_format_name(weight_.format) << ", " << weight_.spec.describe()
         << ", bias=" << (bias_.defined() ? "true" : "false") << ")";
}

// Buffers share their tensors with weight_, and Module::to changes them in place (set_data).
void CompressedLinear::to(torch::Dtype dtype, bool non_blocking) {
  if (bias_.defined()) bias_.set_data(bias_.to(dtype, non_blocking));
}

void CompressedLinear::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  to(dtype, non_blocking);
}

const CompressedLinear* stored_compressed_layer(const LinearLayer& layer) {
  if (const auto* wrapper = dynamic_cast<const InputQuantizedLinear*>(&layer)) {
    return dynamic_cast<const CompressedLinear*>(wrapper->inner().get());
  }
  return dynamic_cast<const CompressedLinear*>(&layer);
}

std::vector<std::string> decompress_stored_linear_layers(torch::nn::Module& root, torch::ScalarType dtype) {
  return replace_linear_layers(
      root, [](const std::string&, const LinearLayer& layer) { return stored_compressed_layer(layer) != nullptr; },
      [dtype](const LinearLayer& layer) {
        DenseLinearOptions options;
        options.in_features = layer.in_features();
        options.out_features = layer.out_features();
        options.bias = layer.bias().defined();
        options.dtype = dtype;
        auto dense = std::make_shared<DenseLinear>(options);
        dense->to(module_device(layer));
        dense->weight().copy_(layer.dense_weight(dtype));
        if (options.bias) dense->bias().copy_(layer.bias());
        return dense;
      });
}

namespace {

// Whether `layer` is stored as e4m3 rows with one scale each (FP8_DYNAMIC's weights).
bool stores_float8_rows(const LinearLayer& layer) {
  const auto* stored = stored_compressed_layer(layer);
  if (stored == nullptr) return false;
  const auto& weight = stored->compressed_weight();
  return weight.format == CompressionFormat::kFloatQuantized && weight.spec.granularity == Granularity::kPerChannel;
}

}  // namespace

std::vector<std::string> multiply_stored_float8_rows_on_tensor_cores(torch::nn::Module& root, torch::ScalarType compute_dtype,
                                                                     bool fast_accumulation) {
  return replace_linear_layers(
      root, [](const std::string&, const LinearLayer& layer) { return stores_float8_rows(layer); },
      [&](const LinearLayer& layer) {
        const auto& weight = stored_compressed_layer(layer)->compressed_weight();
        Float8Rows rows{weight.data, weight.scale.to(torch::kFloat32).reshape({weight.out_features, 1})};
        return std::make_shared<Float8Linear>(rows, layer.bias(), compute_dtype, fast_accumulation);
      });
}

}  // namespace qtrain::qat
