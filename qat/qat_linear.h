#pragma once
// A quantization-aware linear layer: the weight (and optionally the input) fake-quantized in the
// forward, so training sees the rounding that the exported model will have:
//
//     y = fq_in(x) fq_w(W)^T + b,   W = inner.dense_weight(fp32)
//
// `inner` is the layer being trained: a DenseLinear (full fine-tuning: W is its trainable
// weight) or a LoraLinear (W = W0 + scale * B A, the merged weight, so that what is fake-
// quantized is what a merged export writes; gradients reach A and B through the merge). Any
// LinearLayer whose dense_weight is differentiable works.
//
// Names: the inner layer's parameters, buffers and children are registered on the QatLinear
// under their own names, so `q_proj.weight` (dense) or `q_proj.base_layer.weight`,
// `q_proj.lora_A.weight`, `q_proj.lora_B.weight` (LoRA) keep the names Hugging Face and peft
// use; the quantizers add `q_proj.weight_fake_quant.*` and `q_proj.activation_fake_quant.*`.
//
// `convert()` gives the weight's integer codes and scales (+ zero points) exactly as the forward
// used them: convert().dequantize() equals the fake-quantized weight bit for bit.
//
// A LoRA layer whose weight quantizer qat/qat_lora_matmul.h takes (integer grid, dynamic
// per-group or per-channel scales) runs as that one node instead of the composition above: the
// merged weight built and rounded in one pass, no fp32 copy, and the LoRA gradient the options
// name. convert() then reads the same builder.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/fake_quantizer.h"
#include "qat/linear.h"
#include "qat/lora_linear.h"
#include "qat/qat_lora_matmul.h"

namespace qtrain::qat {

struct QatLinearOptions {
  FakeQuantizerOptions weights;                     // recipe `qat.weights`
  std::optional<FakeQuantizerOptions> activations;  // recipe `qat.activations`; none: inputs unquantized
  LoraGradient lora_gradient = LoraGradient::kIdentity;  // recipe `qat.lora_gradient` (qat/qat_lora_matmul.h)
  // The weight spec of the layer named `name` (module path), where layers differ: a GGUF file
  // type gives each tensor its own block type (Q4_K_M: Q6_K for some). Null: `weights.spec` for all.
  std::function<QuantSpec(const std::string& name)> weight_spec_of;
};

class QatLinear : public LinearLayer {
 public:
  // `what`: the recipe section for messages ("qat"); the quantizers are named what + ".weights"
  // and what + ".activations". Fake quantization starts enabled.
  QatLinear(std::shared_ptr<LinearLayer> inner, const QatLinearOptions& options, const std::string& what = "qat");

  // input [..., in] -> [..., out] in the input's dtype.
  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  // The weight the forward multiplies by: fake-quantized while fake quant is enabled.
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  torch::Tensor bias() const override { return inner_->bias(); }
  void pretty_print(std::ostream& stream) const override;

  // `qat.start_step`: the trainer disables fake quant before it and enables it from then on;
  // observers run either way unless disabled (PTQ calibration: observers on, fake quant off).
  void set_fake_quant_enabled(bool enabled);
  bool fake_quant_enabled() const { return weight_fake_quant_->fake_quant_enabled(); }
  void set_observer_enabled(bool enabled);

  // The weight as integer codes + scale (+ zero point), with the quantizer's current parameters.
  // An Error for format gguf, whose codes and scales are convert_gguf_grid's.
  QuantizedTensor convert() const;
  // Format gguf: the weight on its GGUF block type's grid, exactly as the forward rounds it.
  GgufGridTensor convert_gguf_grid() const;

  const std::shared_ptr<LinearLayer>& inner() const { return inner_; }
  FakeQuantizer& weight_fake_quant() const { return *weight_fake_quant_; }
  FakeQuantizer* activation_fake_quant() const { return activation_fake_quant_.get(); }

 private:
  std::shared_ptr<LinearLayer> inner_;
  std::shared_ptr<LoraLinear> fused_lora_;  // inner_ when qat_lora_matmul takes it, else null
  LoraGradient lora_gradient_;
  std::shared_ptr<FakeQuantizer> weight_fake_quant_;
  std::shared_ptr<FakeQuantizer> activation_fake_quant_;  // null when inputs are not quantized
};

// Wraps every linear layer of `root` that `targets` selects (LoRA-wrapped layers as a whole,
// never the base inside them; layers already QAT are skipped) in a QatLinear and returns the
// wrapped names. Apply LoRA first when both are used. An Error when nothing matches.
std::vector<std::string> apply_qat(torch::nn::Module& root, const LoraTargets& targets, const QatLinearOptions& options,
                                   const std::string& what = "qat");

// The QatLinear layers under `root`, in module order.
std::vector<std::pair<std::string, std::shared_ptr<QatLinear>>> find_qat_layers(const torch::nn::Module& root);

// The switches of every QatLinear under `root`.
void set_fake_quant_enabled(torch::nn::Module& root, bool enabled);
void set_observer_enabled(torch::nn::Module& root, bool enabled);
// Whether every quantizer under `root` has a scale to use (FakeQuantizer::has_scale): false
// before a static range was first observed.
bool quantizers_have_scales(const torch::nn::Module& root);

}  // namespace qtrain::qat
