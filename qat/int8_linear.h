#pragma once
// A frozen LLM.int8 linear layer: bitsandbytes' Linear8bitLt with has_fp16_weights=False (what
// `load_in_8bit=True` builds, and the base of LoRA on an 8-bit model). The weight lives only as
// row-wise int8 codes and their row absmax; forward is LLM.int8's mixed-precision decomposition
// (qat/int8_codec.h: input columns holding a value >= threshold in 16-bit against the dequantized
// weight columns, the rest int8 x int8 -> int32 -> rescaled), so
//
//     y ~= x dequantize(W)^T + b.
//
// Backward reaches the input through the dequantized weight (the base never trains), as bnb's
// MatMul8bitLt: dx = dy dequantize(W), in the input's dtype.
//
// Buffers (no parameters), under the keys of a load_in_8bit checkpoint for `<m>`:
//   weight  int8 [out, in]   the codes (bnb's CB)         <m>.weight
//   SCB     fp32 [out]       each row's absmax            <m>.SCB
//   bias    compute dtype [out]  (when present)           <m>.bias
// (the checkpoint's `<m>.weight_format` is 0, row-major, and is not kept).
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/layer_replacement.h"
#include "qat/linear.h"

namespace qtrain::qat {

struct Int8Options {
  double threshold = 6.0;  // llm_int8_threshold: input features at or above it run in 16-bit; 0: none
  torch::ScalarType compute_dtype = torch::kBFloat16;  // of the bias
  // Where each weight is quantized and kept (unset: where it is).
  std::optional<torch::Device> device;
};

class Int8Linear : public LinearLayer {
 public:
  // `codes` int8 [out, in], `absmax` fp32 [out] (SCB), `bias` [out] or undefined. An Error naming
  // `what` when they do not fit together or the threshold is negative.
  Int8Linear(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& bias, double threshold,
             torch::ScalarType compute_dtype, const std::string& what = "Int8Linear");
  // Quantizes a dense [out, in] weight (on its device) as Linear8bitLt does on its first move to
  // the GPU: int8_vectorwise_quant of the fp16 weight, threshold 0.
  static std::shared_ptr<Int8Linear> from_dense(const torch::Tensor& weight, const torch::Tensor& bias,
                                                const Int8Options& options);

  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return codes_.size(1); }
  int64_t out_features() const override { return codes_.size(0); }
  // int8_vectorwise_dequant: codes * SCB / 127 in fp32, then `dtype`.
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  torch::Tensor bias() const override { return bias_; }
  void pretty_print(std::ostream& stream) const override;

  const torch::Tensor& codes() const { return codes_; }
  const torch::Tensor& absmax() const { return absmax_; }
  double threshold() const { return threshold_; }

  // Module::to converts every buffer; only the bias may change dtype here.
  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;

 private:
  torch::Tensor codes_;
  torch::Tensor absmax_;
  torch::Tensor bias_;
  double threshold_;
};

// Replaces every DenseLinear under `root` whose name does not match `skip_modules` (as
// module_name_matches) by an Int8Linear quantized from its weight. Returns the replaced names.
std::vector<std::string> quantize_linear_layers_int8(torch::nn::Module& root, const Int8Options& options,
                                                     const std::vector<std::string>& skip_modules);

}  // namespace qtrain::qat
