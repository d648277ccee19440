#pragma once
// A frozen linear layer whose weight stays in a compressed-tensors checkpoint's stored form
// (qat/compressed_weight.h: packed int4 / int8 codes, e4m3, NVFP4, with their scales): the base of
// LoRA on such a checkpoint, `quant: none`, at the checkpoint's own memory (int4: about a quarter
// of bf16's). Each product dequantizes the weight as compressed-tensors decompresses it and
// multiplies in the input's dtype,
//
//     y = x dequantize(W)^T + b,
//
// so gradients reach the input and an adapter around the layer, never the base. A preset that
// quantizes input activations (W8A8, FP8_DYNAMIC) wraps this layer in InputQuantizedLinear.
//
// Buffers, under the checkpoint's names for module `<m>`: `weight_packed` (pack-quantized,
// nvfp4-pack-quantized) or `weight` (int-quantized, float-quantized, fine-grained FP8),
// `weight_scale` (fine-grained FP8: `weight_scale_inv`),
// `weight_zero_point` (asymmetric), `weight_global_scale` (nvfp4), `bias` (compute dtype).
#include <torch/torch.h>

#include <string>
#include <vector>

#include "qat/compressed_weight.h"
#include "qat/linear.h"

namespace qtrain::qat {

class CompressedLinear : public LinearLayer {
 public:
  // `bias` [out] or undefined, kept in `compute_dtype`.
  CompressedLinear(CompressedWeight weight, const torch::Tensor& bias, torch::ScalarType compute_dtype);

  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return weight_.in_features; }
  int64_t out_features() const override { return weight_.out_features; }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override { return weight_.dequantize(dtype); }
  MatmulWeight matmul_weight_kind() const override { return MatmulWeight::kBuilt; }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override { return weight_.dequantize(dtype); }
  torch::Tensor bias() const override { return bias_; }
  void pretty_print(std::ostream& stream) const override;

  const CompressedWeight& compressed_weight() const { return weight_; }
  // The names of the buffers holding the codes (weight_packed or weight) and the scales
  // (weight_scale; fine-grained FP8's weight_scale_inv).
  static const char* data_name(CompressionFormat format);
  static const char* scale_name(CompressionFormat format);

  // Module::to moves every buffer; only the bias changes dtype (the stored form is the point).
  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;

 private:
  CompressedWeight weight_;  // its tensors are this module's buffers
  torch::Tensor bias_;
};

// The stored layer of `layer`: itself, or the one an InputQuantizedLinear wraps; null for any other.
const CompressedLinear* stored_compressed_layer(const LinearLayer& layer);

// Replaces every stored layer under `root` (with its input quantization, if any) by a dense layer
// holding its dequantized weight in `dtype`: a base quantized again (quant: qlora) or trained
// through QAT starts from the checkpoint's values. Returns the names replaced.
std::vector<std::string> decompress_stored_linear_layers(torch::nn::Module& root, torch::ScalarType dtype);

// The projections under `root` kept as e4m3 with a scale per output row (compressed-tensors'
// FP8_DYNAMIC: float-quantized, per channel; with or without their per-token input quantization)
// become Float8Linear layers of the same codes and scales, which multiply on FP8 tensor cores and
// quantize their inputs per token themselves (qlora.fp8_compute on such a checkpoint). Returns the
// names replaced.
std::vector<std::string> multiply_stored_float8_rows_on_tensor_cores(torch::nn::Module& root, torch::ScalarType compute_dtype,
                                                                     bool fast_accumulation);

}  // namespace qtrain::qat
