#pragma once
// The dense feed-forward block: a gated MLP, down(act(gate(x)) * up(x)), with SwiGLU (Llama,
// Mistral, Qwen) or GeGLU (Gemma) as LlamaOptions::activation says, and gate and up as one
// projection where LlamaOptions::fused_projections says (Phi-3).
#include <torch/torch.h>

#include <memory>
#include <string>

#include "trainer/model/feed_forward.h"

namespace qtrain::trainer {

class DenseMlpImpl : public FeedForwardImpl {
 public:
  DenseMlpImpl(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
               torch::ScalarType dtype);
  // `rebuild_hidden`: for gate and up.
  torch::Tensor forward(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden = {}) override;
  // down_proj as qat::LinearLayer::forward_for_graph.
  torch::Tensor forward_for_graph(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden) override;
  void replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) override;
  std::shared_ptr<qat::LinearLayer> gate_proj, up_proj, down_proj;
  std::shared_ptr<qat::LinearLayer> gate_up_proj;  // instead of gate and up: LlamaOptions::fused_projections

 private:
  std::shared_ptr<qat::LinearLayer>* slot(const std::string& child_name);
  torch::Tensor run(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden, bool for_graph);
  Activation activation_;
};
TORCH_MODULE(DenseMlp);

// FeedForwardKind::kDense's row.
const FeedForwardRow& dense_mlp_row();

}  // namespace qtrain::trainer
