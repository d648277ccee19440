#include "trainer/model/causal_lm_loss.h"

#include <optional>

#include "trainer/model/activation_checkpoint.h"
#include "trainer/model/fused_linear_cross_entropy.h"

namespace qtrain::trainer {

namespace F = torch::nn::functional;

namespace {

// lm_head, or the tied embeddings, as the frozen weight the fused loss multiplies by; nothing
// when its forward is more than x W^T + b (LoRA, QAT, LLM.int8) or, with grad mode on, a weight
// of it trains.
std::optional<OutputProjection> frozen_output_projection(LlamaForCausalLMImpl& model) {
  const bool differentiating = torch::GradMode::is_enabled();
  OutputProjection projection;
  projection.softcap = model.options().final_logit_softcap;
  if (model.lm_head) {
    if (model.lm_head->matmul_weight_kind() == qat::LinearLayer::MatmulWeight::kNone) return std::nullopt;
    for (const auto& parameter : model.lm_head->parameters()) {
      if (differentiating && parameter.requires_grad()) return std::nullopt;
    }
    projection.layer = model.lm_head;
  } else {
    projection.weight = model.model->embed_tokens->weight;
    if (differentiating && projection.weight.requires_grad()) return std::nullopt;
  }
  return projection;
}

// Each chunk's whole fp32 logits, then cross_entropy; checkpointed chunks under autograd.
torch::Tensor logits_loss_sum(LlamaForCausalLMImpl& model, const torch::Tensor& predicting,
                              const torch::Tensor& targets, int64_t chunk_tokens) {
  using torch::indexing::Slice;
  const int64_t total = targets.size(0);
  const bool chunked = chunk_tokens < total;
  // The trainable weights the projection uses (a LoRA lm_head, a trained embedding).
  std::vector<torch::Tensor> projection_parameters;
  if (chunked) {
    for (const auto& parameter :
         model.lm_head ? model.lm_head->parameters() : model.model->embed_tokens->parameters()) {
      if (parameter.requires_grad()) projection_parameters.push_back(parameter);
    }
  }
  auto loss_sum = torch::zeros({}, predicting.options().dtype(torch::kFloat32));
  for (int64_t begin = 0; begin < total; begin += chunk_tokens) {
    const int64_t end = std::min(total, begin + chunk_tokens);
    const auto chunk_targets = targets.index({Slice(begin, end)});
    const auto chunk_loss = [&model, chunk_targets](const std::vector<torch::Tensor>& inputs) {
      auto logits = model.logits(inputs[0]).to(torch::kFloat32);
      return F::cross_entropy(logits, chunk_targets,
                              F::CrossEntropyFuncOptions().ignore_index(kIgnoreLabel).reduction(torch::kSum));
    };
    const auto states = predicting.index({Slice(begin, end)});
    loss_sum = loss_sum + (chunked ? checkpoint(chunk_loss, {states}, projection_parameters) : chunk_loss({states}));
  }
  return loss_sum;
}

}  // namespace

TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         const LossOptions& options) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  const int64_t width = hidden.size(-1);
  auto predicting = hidden.index({Slice(), Slice(0, -1)}).reshape({-1, width});  // [tokens, hidden]
  auto targets = labels.index({Slice(), Slice(1, None)}).reshape({-1});          // [tokens]
  const int64_t total = targets.size(0);
  const int64_t chunk_tokens = options.chunk_tokens > 0 ? options.chunk_tokens : std::max<int64_t>(total, 1);

  TokenLoss result;
  auto projection = options.fused ? frozen_output_projection(model) : std::nullopt;
  if (projection && model.lm_head_on_host()) {
    // Its copy on the device, which the loss's backward lets go of (train.lm_head_on_host).
    projection->layer = nullptr;
    projection->weight = model.take_lm_head_weight();
    projection->weight_bias = model.lm_head_bias_on_device();
  }
  if (projection) {
    FusedLossOptions fused;
    fused.chunk_tokens = chunk_tokens;
    fused.tile_columns = options.vocabulary_tile;
    result.loss_sum = fused_linear_cross_entropy(predicting, targets, *projection, fused);
  } else {
    result.loss_sum = logits_loss_sum(model, predicting, targets, chunk_tokens);
  }
  result.tokens = targets.ne(kIgnoreLabel).sum();
  return result;
}

TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         int64_t chunk_tokens) {
  LossOptions options;
  options.chunk_tokens = chunk_tokens;
  options.fused = false;
  return causal_lm_loss(model, hidden, labels, options);
}

bool fused_loss_applies(LlamaForCausalLMImpl& model) { return frozen_output_projection(model).has_value(); }

int64_t auto_loss_chunk_tokens(int64_t vocab_size) {
  constexpr int64_t kBudgetBytes = int64_t{512} << 20;
  const int64_t tokens = kBudgetBytes / (std::max<int64_t>(vocab_size, 1) * 4) / 256 * 256;
  return std::max<int64_t>(tokens, 256);
}

}  // namespace qtrain::trainer
