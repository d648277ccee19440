#pragma once
// A linear layer whose input is fake-quantized and whose weight is used as it is:
//
//     y = fq_in(x) W^T + b
//
// What a QAT model with quantized activations becomes once its weights are stored quantized
// (a safetensors-int export): W is already the dequantized grid weight (re-quantizing it would
// not give the same values back: symmetric absmax / 7.5 scales are not idempotent), and the
// input is quantized exactly as QatLinear quantized it in training.
//
// Names: the inner layer's parameters, buffers and children under their own names (`weight`,
// `bias`), plus `activation_fake_quant.*`, as in QatLinear.
#include <torch/torch.h>

#include <memory>
#include <string>

#include "qat/fake_quantizer.h"
#include "qat/linear.h"

namespace qtrain::qat {

class InputQuantizedLinear : public LinearLayer {
 public:
  // `what`: the quantizer's key for messages ("qat.activations").
  InputQuantizedLinear(std::shared_ptr<LinearLayer> inner, const FakeQuantizerOptions& activations,
                       const std::string& what = "qat.activations");

  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override { return inner_->dense_weight(dtype); }
  torch::Tensor bias() const override { return inner_->bias(); }
  void pretty_print(std::ostream& stream) const override;

  const std::shared_ptr<LinearLayer>& inner() const { return inner_; }
  FakeQuantizer& activation_fake_quant() const { return *activation_fake_quant_; }

 private:
  std::shared_ptr<LinearLayer> inner_;
  std::shared_ptr<FakeQuantizer> activation_fake_quant_;
};

}  // namespace qtrain::qat
