#include "qat/four_bit_matmul.h"

#include <torch/csrc/autograd/function.h>

#include "qat/linear.h"

namespace qtrain::qat {

namespace {

// Holds the packed weight and its quant state (buffers, shared, not copied) instead of a
// dequantized weight.
class FourBitMatmulBackward : public torch::autograd::Node {
 public:
  // `kept`: the dequantized weight, when KeepBuiltWeights asked for it to be kept.
  FourBitMatmulBackward(torch::Tensor packed, FourBitQuantState state, torch::ScalarType dtype, torch::Tensor kept)
      : packed_(std::move(packed)), state_(std::move(state)), dtype_(dtype), kept_(std::move(kept)) {}
  std::string name() const override { return "qtrain::FourBitMatmulBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const auto weight = kept_.defined() ? kept_ : dequantize_4bit(packed_, state_, dtype_);  // [out, in]
    return {grads[0].matmul(weight)};
  }

  // The engine calls this after apply unless the graph is retained.
  void release_variables() override { kept_ = torch::Tensor(); }

 private:
  torch::Tensor packed_;
  FourBitQuantState state_;
  torch::ScalarType dtype_;
  torch::Tensor kept_;
};

}  // namespace

torch::Tensor four_bit_matmul(const torch::Tensor& input, const torch::Tensor& packed, const FourBitQuantState& state) {
  torch::Tensor output, weight;
  {
    torch::NoGradGuard no_grad;
    weight = dequantize_4bit(packed, state, input.scalar_type());
    output = torch::nn::functional::linear(input, weight);
  }
  if (torch::GradMode::is_enabled() && input.requires_grad()) {
    auto node = std::shared_ptr<FourBitMatmulBackward>(
        new FourBitMatmulBackward(packed, state, input.scalar_type(),
                                  KeepBuiltWeights::active() ? weight : torch::Tensor()),
        torch::autograd::deleteNode);
    node->set_next_edges({torch::autograd::impl::gradient_edge(input)});
    torch::autograd::create_gradient_edge(output, node);
  }
  return output;
}

}  // namespace qtrain::qat
