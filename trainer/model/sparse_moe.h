#pragma once
// The mixture-of-experts feed-forward block (FeedForwardKind::kExperts) of Qwen3-MoE, Mixtral and
// gpt-oss, as transformers 5 computes it:
//
//     p = softmax(x G^T) in fp32          router `gate` [experts, hidden]
//     w, e = top-k of p                   (w / sum(w) where ExpertOptions::normalize_top_k)
//     y = Σ_k down_e(w_k · act(gate_e(x)) · up_e(x))    (transformers: w_k · down_e(...), the same
//                                                     to rounding; gpt-oss, whose banks have biases, so)
//
// (gpt-oss: the router has a bias and weighs the top-k logits by their own softmax, the banks have
// biases, the activation is clamped: ExpertOptions.)
// Each expert's gate and up are one fused weight (`experts.gate_up_proj`, gate's rows first, as
// transformers' [experts, 2 · intermediate, hidden] parameter), its down `experts.down_proj`; both
// are expert banks (qat/expert_linear.h), so every frozen-base kind and LoRA (peft's
// target_parameters form) reach them as any projection. Tokens are sorted by expert once per
// layer and each bank runs as one grouped GEMM on the GPU (no host synchronisation per expert).
#include <torch/torch.h>

#include <memory>
#include <string>

#include "qat/expert_linear.h"
#include "trainer/model/feed_forward.h"
#include "trainer/model/router_loss.h"

namespace qtrain::trainer {

// The rows (token, choice) the experts take, sorted by expert: `token_of_row` gives each row's
// token, `by_token` each token's k rows in row (so expert) order.
struct RowRouting {
  torch::Tensor token_of_row, by_token;
  int64_t k = 1;
};
// From `order`, the rows' (token, choice) pairs as flat indices token * k + choice (a stable sort
// of the choices by expert).
RowRouting route_rows(const torch::Tensor& order, int64_t k);
// x's rows [tokens, hidden] gathered into the experts' rows; backward sums each token's row
// gradients as sum_rows_by_token does.
torch::Tensor gather_token_rows(const torch::Tensor& x, const RowRouting& routing);
// Each token's k rows summed in expert order from zero in fp32, rounded to the rows' dtype once:
// transformers' index_add_ into zeros as the CPU computes it, bit for bit, by a gather and k adds
// instead of CUDA's atomics (which add in the rows' dtype, in no fixed order). Backward gathers
// as gather_token_rows.
torch::Tensor sum_rows_by_token(const torch::Tensor& rows, const RowRouting& routing);

// The experts' banks: `gate_up_proj` [experts × 2 · intermediate, hidden], `down_proj`
// [experts × hidden, intermediate].
class ExpertBanksImpl : public torch::nn::Module, public qat::LinearLayerOwner, public qat::ExpertBankOwner {
 public:
  ExpertBanksImpl(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                  torch::ScalarType dtype);
  // rows [tokens · k, hidden] sorted by expert, counts [experts], row_experts [tokens · k] (each
  // row's expert; needed only where the banks have biases) -> each row's expert output.
  // row_weights [tokens · k, 1]: the activation's rows are scaled by them before down_proj (banks
  // without biases). `output_unread`: down_proj's product is left out (qat::bank_product_for_graph).
  torch::Tensor forward(const torch::Tensor& rows, const torch::Tensor& counts, const torch::Tensor& row_experts,
                        const torch::Tensor& row_weights = {}, bool output_unread = false);
  void replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) override;
  int64_t bank_experts(const std::string& child_name) const override;
  std::shared_ptr<qat::LinearLayer> gate_up_proj, down_proj;

 private:
  std::shared_ptr<qat::LinearLayer>* slot(const std::string& child_name);
  int64_t experts_;
  Activation activation_;
  double swiglu_limit_;
};
TORCH_MODULE(ExpertBanks);

class SparseMoeBlockImpl : public FeedForwardImpl {
 public:
  SparseMoeBlockImpl(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                     torch::ScalarType dtype);
  torch::Tensor forward(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden = {}) override;
  // Without banks' biases the router's weights scale down_proj's input rows, so no backward reads
  // its output, and this leaves its product out; with them (gpt-oss) it is forward.
  torch::Tensor forward_for_graph(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden) override;
  void replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) override;
  void share_router_loss(const std::shared_ptr<RouterLoss>& loss) override { router_loss_ = loss; }
  std::shared_ptr<qat::LinearLayer> gate;  // the router, [experts, hidden], registered as ExpertOptions::router
  ExpertBanks experts{nullptr};

 private:
  torch::Tensor run(const torch::Tensor& hidden, bool for_graph);
  ExpertOptions options_;
  std::string router_name_;
  std::shared_ptr<RouterLoss> router_loss_;
};
TORCH_MODULE(SparseMoeBlock);

// FeedForwardKind::kExperts's row.
const FeedForwardRow& sparse_moe_row();

}  // namespace qtrain::trainer
