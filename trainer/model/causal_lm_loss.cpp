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

// Each chunk's whole fp32 logits, then cross_entropy; checkpointed chunks under autograd. The sum
// of the per-token losses, or with `per_token` the losses [tokens] (0 where ignored).
torch::Tensor logits_losses(LlamaForCausalLMImpl& model, const torch::Tensor& predicting, const torch::Tensor& targets,
                            int64_t chunk_tokens, bool per_token) {
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
  std::vector<torch::Tensor> token_losses;
  for (int64_t begin = 0; begin < total; begin += chunk_tokens) {
    const int64_t end = std::min(total, begin + chunk_tokens);
    const auto chunk_targets = targets.index({Slice(begin, end)});
    const auto chunk_loss = [&model, chunk_targets, per_token](const std::vector<torch::Tensor>& inputs) {
      auto logits = model.logits(inputs[0]).to(torch::kFloat32);
      auto options = F::CrossEntropyFuncOptions().ignore_index(kIgnoreLabel);
      if (per_token) {
        options.reduction(torch::kNone);
      } else {
        options.reduction(torch::kSum);
      }
      return F::cross_entropy(logits, chunk_targets, options);
    };
    const auto states = predicting.index({Slice(begin, end)});
    auto losses = chunked ? checkpoint(chunk_loss, {states}, projection_parameters) : chunk_loss({states});
    if (per_token) {
      token_losses.push_back(std::move(losses));
    } else {
      loss_sum = loss_sum + losses;
    }
  }
  if (!per_token) return loss_sum;
  return token_losses.empty() ? torch::zeros({0}, loss_sum.options()) : torch::cat(token_losses);
}

// The frozen projection the fused loss multiplies by, where options.fused and the model allow it
// (with train.lm_head_on_host, its copy on the device, which the loss lets go of; or, under
// train.lm_head_block_mb, the host weight that the loss takes a tile at a time).
std::optional<OutputProjection> loss_projection(LlamaForCausalLMImpl& model, const LossOptions& options) {
  auto projection = options.fused ? frozen_output_projection(model) : std::nullopt;
  if (projection && model.lm_head_on_host()) {
    projection->layer = nullptr;
    projection->weight_bias = model.lm_head_bias_on_device();
    if (model.lm_head_block_bytes() > 0) {  // a tile at a time (train.lm_head_block_mb)
      projection->weight = torch::Tensor();
      projection->host_tiles = model.host_lm_head();
      projection->host_block_bytes = model.lm_head_block_bytes();
    } else {
      projection->weight = model.take_lm_head_weight();
    }
  }
  return projection;
}

FusedLossOptions fused_options(const LossOptions& options, int64_t chunk_tokens) {
  FusedLossOptions fused;
  fused.chunk_tokens = chunk_tokens;
  fused.tile_columns = options.vocabulary_tile;
  fused.gradient = options.gradient;
  return fused;
}

}  // namespace

TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         const LossOptions& options, const torch::Tensor& host_labels) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  const int64_t width = hidden.size(-1);
  auto predicting = hidden.index({Slice(), Slice(0, -1)}).reshape({-1, width});  // [tokens, hidden]
  auto targets = labels.index({Slice(), Slice(1, None)}).reshape({-1});          // [tokens]
  if (host_labels.defined() && host_labels.is_cpu()) {
    const auto kept = host_labels.index({Slice(), Slice(1, None)}).reshape({-1}).ne(kIgnoreLabel).nonzero().view(-1);
    // The gather and its backward's scatter cost about as much as projecting a few dozen tokens
    // of an 8B model's step: a few ignored targets (packed documents' boundaries) are projected.
    constexpr int64_t kLeastIgnoredShare = 32;  // 1 in 32
    const int64_t ignored = targets.size(0) - kept.numel();
    if (kept.numel() > 0 && ignored > 0 && ignored * kLeastIgnoredShare >= targets.size(0)) {
      // The forward is queued by now: a copy from pageable memory would wait for it (a blocking
      // copy synchronizes the stream), so the positions go from pinned memory without waiting.
      const auto rows = predicting.is_cuda() ? kept.pin_memory().to(predicting.device(), /*non_blocking=*/true) : kept;
      predicting = predicting.index_select(0, rows);
      targets = targets.index_select(0, rows);
    }
  }
  const int64_t total = targets.size(0);
  const int64_t chunk_tokens = options.chunk_tokens > 0 ? options.chunk_tokens : std::max<int64_t>(total, 1);

  TokenLoss result;
  if (auto projection = loss_projection(model, options)) {
    result.loss_sum = fused_linear_cross_entropy(predicting, targets, *projection, fused_options(options, chunk_tokens));
  } else {
    result.loss_sum = logits_losses(model, predicting, targets, chunk_tokens, /*per_token=*/false);
  }
  result.tokens = targets.ne(kIgnoreLabel).sum();
  return result;
}

torch::Tensor token_log_probs(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& targets,
                              const LossOptions& options) {
  const auto states = hidden.reshape({-1, hidden.size(-1)});
  const auto flat_targets = targets.reshape({-1});
  const int64_t total = flat_targets.size(0);
  const int64_t chunk_tokens = options.chunk_tokens > 0 ? options.chunk_tokens : std::max<int64_t>(total, 1);
  torch::Tensor losses;
  if (auto projection = loss_projection(model, options)) {
    losses = fused_linear_token_losses(states, flat_targets, *projection, fused_options(options, chunk_tokens));
  } else {
    losses = logits_losses(model, states, flat_targets, chunk_tokens, /*per_token=*/true);
  }
  return losses.neg().view(targets.sizes());
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
