#pragma once
// The decoder layer's feed-forward block: what runs on the residual stream after attention. A
// dense gated MLP (trainer/model/dense_mlp.h) or a router and its experts (sparse_moe.h). The layer, its MLP chunks, the memory
// estimate and LoRA targeting reach the block only through FeedForwardImpl and its row, so a new
// kind (experts and a router) is one class, one FeedForwardKind and one case in feed_forward_row.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "qat/linear.h"
#include "trainer/model/llama_options.h"
#include "trainer/model/projections.h"
#include "trainer/model/router_loss.h"

namespace qtrain::trainer {

// A block holding projections implements qat::LinearLayerOwner, so that swapping one (LoRA, QAT)
// updates the member forward() calls as well as the registered child.
class FeedForwardImpl : public torch::nn::Module, public qat::LinearLayerOwner {
 public:
  // hidden [batch, seq, hidden], the normed residual stream -> the block's output, same shape.
  // Each token's output depends on that token alone, so the layer may run the block over slices
  // of tokens (LlamaDecoderLayerImpl::set_mlp_chunk_tokens). `rebuild_hidden`:
  // LinearLayer::forward_rebuilding_input's, for the projections that read `hidden`.
  virtual torch::Tensor forward(const torch::Tensor& hidden,
                                const qat::LinearLayer::InputRebuild& rebuild_hidden = {}) = 0;
  // forward(hidden, rebuild_hidden) where nothing reads the output's values, only its place in
  // autograd's graph (a checkpointed layer's recomputation: the block's output joins the residual
  // stream that is the layer's output). A block whose backward reads no value of its last
  // projection's output (a dense MLP's down_proj, experts whose router weighs down's input rows)
  // runs that one without its product (qat::LinearLayer::forward_for_graph,
  // qat::bank_product_for_graph); one that reads it runs forward.
  virtual torch::Tensor forward_for_graph(const torch::Tensor& hidden,
                                          const qat::LinearLayer::InputRebuild& rebuild_hidden) {
    return forward(hidden, rebuild_hidden);
  }
  // The model's load-balancing loss (trainer/model/router_loss.h), which a block with a router
  // reports to; the others ignore it.
  virtual void share_router_loss(const std::shared_ptr<RouterLoss>& loss) { (void)loss; }
};
TORCH_MODULE(FeedForward);

// What the rest of the code base asks of a feed-forward kind, without building one.
struct FeedForwardRow {
  FeedForwardKind kind;
  // Its module under the decoder layer, transformers' name ("mlp": model.layers.N.mlp.up_proj).
  const char* module_name;
  // Its projections, named relative to the block, in the order the block registers them.
  std::vector<ProjectionShape> (*projections)(const LlamaOptions& options);
  // Values of the compute dtype per token that its activation function keeps for backward, beside
  // what its projections keep of their inputs: with the fused CUDA kernels
  // (trainer/model/llama_layers.h) or the torch operations.
  double (*activation_values_per_token)(const LlamaOptions& options, bool fused_kernels);
  // The block of one decoder layer; make_linear gets prefix + "." + projection name, with
  // `prefix` like "model.layers.3.mlp".
  FeedForward (*make)(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                      torch::ScalarType dtype);
};

// The projections of `options`' blocks that a quantized base leaves dense (stays_dense), as
// "MODULE.NAME" ("mlp.gate"): entries for qlora.skip_modules' list.
std::vector<std::string> dense_base_projections(const LlamaOptions& options);
// Every projection name of options.projection_names() but those (a router): what `qtrain bench`
// adapts, as the peers' recipes leave a router frozen.
std::vector<std::string> projections_but_dense_base(const LlamaOptions& options);

// The row of `kind`; of options.feed_forward, the model's block (its dense_layers take kDense's).
const FeedForwardRow& feed_forward_row(FeedForwardKind kind);
inline const FeedForwardRow& feed_forward_row(const LlamaOptions& options) { return feed_forward_row(options.feed_forward); }

}  // namespace qtrain::trainer
