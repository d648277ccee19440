#pragma once
// A frozen 4-bit linear layer: bitsandbytes' Linear4bit (the QLoRA base). The weight lives only
// in its packed form; forward dequantizes it to the input's dtype and multiplies,
//
//     y = x dequantize_4bit(W)^T + b,
//
// so gradients reach the input (and a LoRA adapter around the layer) but never the base.
//
// Buffers (no parameters), and the keys a bnb checkpoint stores them under for `<m>.weight`:
//   weight            uint8 [n/2, 1]  packed codes           <m>.weight
//   absmax            fp32 [blocks], or uint8 when double quantized    <m>.weight.absmax
//   quant_map         fp32 [16]       the 4-bit table        <m>.weight.quant_map
//   nested_absmax     fp32 [blocks/256]  (double quant only) <m>.weight.nested_absmax
//   nested_quant_map  fp32 [256]         (double quant only) <m>.weight.nested_quant_map
//   bias              compute dtype [out]  (when present)    <m>.bias
// The rest of the quant state (quant type, blocksize, shape, dtype, nested_offset) is the JSON
// blob <m>.weight.quant_state.bitsandbytes__<type>, kept here in quant_state().
//
// On FP8 tensor cores (multiply_on_float8): under an adapter (qat/lora_matmul.h)
// the layer multiplies itself. Each product dequantizes the packed bytes straight to e4m3 codes at
// a scale per row (the bf16 weight's row absmax / 448, measured once), in one kernel, and multiplies
// them as the FP8 base does (qat/float8_matmul.h): QLoRA's memory, the FP8 tensor cores' speed,
// one more rounding of each weight (e4m3's 3 mantissa bits, on the bf16 value) than the bf16 path.
// The layer's own forward (no adapter) stays on the bf16 path.
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/float8_codec.h"
#include "qat/four_bit_codec.h"
#include "qat/layer_replacement.h"
#include "qat/linear.h"

namespace qtrain::qat {

struct FourBitOptions {
  std::string quant_type = "nf4";  // nf4 | fp4 (parse_four_bit_type checks it)
  int64_t blocksize = 64;          // 64 ... 4096
  bool double_quant = true;        // bnb_4bit_use_double_quant
  torch::ScalarType compute_dtype = torch::kBFloat16;  // of the bias (forward follows the input's dtype)
  // Where each weight is quantized and kept (unset: where it is). A CUDA device quantizes
  // there, one layer at a time, so the 16-bit model never has to fit on the GPU.
  std::optional<torch::Device> device;
};

class FourBitLinear : public LinearLayer {
 public:
  // `weight` [out, in] with its quant state (state.shape must be 2-d); `bias` [out] or undefined.
  FourBitLinear(FourBitTensor weight, const torch::Tensor& bias, torch::ScalarType compute_dtype);
  // Quantizes a dense [out, in] weight (on its device) as bitsandbytes' Params4bit does.
  static std::shared_ptr<FourBitLinear> from_dense(const torch::Tensor& weight, const torch::Tensor& bias,
                                                   const FourBitOptions& options);

  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return state_.shape[1]; }
  int64_t out_features() const override { return state_.shape[0]; }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  MatmulWeight matmul_weight_kind() const override { return MatmulWeight::kBuilt; }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override { return dense_weight(dtype); }
  // Rows of whole quantization blocks: where in_features is a multiple of the blocksize.
  bool builds_weight_rows() const override;
  torch::Tensor matmul_weight_rows(torch::ScalarType dtype, int64_t begin, int64_t end) const override;
  torch::Tensor bias() const override { return bias_; }
  void pretty_print(std::ostream& stream) const override;

  // From now on, under an adapter, multiply on FP8 tensor cores (see above); `fast_accumulation`
  // as Float8Options'. The caller checks the device (qat::require_float8_tensor_cores).
  void multiply_on_float8(bool fast_accumulation);
  bool multiplies_itself() const override { return float8_; }
  // While KeepBuiltWeights is active the product keeps its e4m3 weight for the input gradient
  // that follows (a checkpointed layer's recomputation), which takes it.
  torch::Tensor own_product(const torch::Tensor& rows, torch::Tensor onto) const override;
  torch::Tensor own_input_gradient(const torch::Tensor& grad_rows, torch::Tensor onto) const override;

  // The packed bytes and quant state (its tensors are this module's buffers).
  const torch::Tensor& packed_weight() const { return packed_; }
  const FourBitQuantState& quant_state() const { return state_; }

  // Module::to converts every buffer; only the bias may change dtype here.
  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;

 private:
  Float8Rows float8_weight() const;  // built from the packed bytes (the row scales on first use)

  torch::Tensor packed_;
  torch::Tensor bias_;
  FourBitQuantState state_;
  bool float8_ = false;
  bool fast_accumulation_ = false;
  mutable torch::Tensor float8_scales_;  // fp32 [out, 1] on the weight's device, measured once
  mutable Float8Rows kept_;              // the last product's weight, for the input gradient after it
};

// Replaces every DenseLinear under `root` whose dotted name does not match `skip_modules` (an
// entry matches a name equal to it or ending in "." + it, as bnb's llm_int8_skip_modules) by a
// FourBitLinear quantized from its weight (replace_dense_linear_layers). Returns the replaced
// names, in module order.
std::vector<std::string> quantize_linear_layers(torch::nn::Module& root, const FourBitOptions& options,
                                                const std::vector<std::string>& skip_modules);

}  // namespace qtrain::qat
