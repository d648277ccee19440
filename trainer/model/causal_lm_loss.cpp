#include "trainer/model/causal_lm_loss.h"

#include "trainer/model/activation_checkpoint.h"

namespace qtrain::trainer {

namespace F = torch::nn::functional;

TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         int64_t chunk_tokens) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  const int64_t width = hidden.size(-1);
  auto predicting = hidden.index({Slice(), Slice(0, -1)}).reshape({-1, width});  // [tokens, hidden]
  auto targets = labels.index({Slice(), Slice(1, None)}).reshape({-1});          // [tokens]
  const int64_t total = targets.size(0);
  if (chunk_tokens <= 0) chunk_tokens = std::max<int64_t>(total, 1);

  const bool chunked = chunk_tokens < total;
  // The trainable weights the projection uses (a LoRA lm_head, a trained embedding).
  std::vector<torch::Tensor> projection_parameters;
  if (chunked) {
    for (const auto& parameter :
         model.lm_head ? model.lm_head->parameters() : model.model->embed_tokens->parameters()) {
      if (parameter.requires_grad()) projection_parameters.push_back(parameter);
    }
  }
  TokenLoss result;
  result.loss_sum = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
  for (int64_t begin = 0; begin < total; begin += chunk_tokens) {
    const int64_t end = std::min(total, begin + chunk_tokens);
    const auto chunk_targets = targets.index({Slice(begin, end)});
    const auto chunk_loss = [&model, chunk_targets](const std::vector<torch::Tensor>& inputs) {
      auto logits = model.logits(inputs[0]).to(torch::kFloat32);
      return F::cross_entropy(logits, chunk_targets,
                              F::CrossEntropyFuncOptions().ignore_index(kIgnoreLabel).reduction(torch::kSum));
    };
    const auto states = predicting.index({Slice(begin, end)});
    result.loss_sum = result.loss_sum + (chunked ? checkpoint(chunk_loss, {states}, projection_parameters)
                                                 : chunk_loss({states}));
  }
  result.tokens = targets.ne(kIgnoreLabel).sum();
  return result;
}

int64_t auto_loss_chunk_tokens(int64_t vocab_size) {
  constexpr int64_t kBudgetBytes = int64_t{512} << 20;
  const int64_t tokens = kBudgetBytes / (std::max<int64_t>(vocab_size, 1) * 4) / 256 * 256;
  return std::max<int64_t>(tokens, 256);
}

}  // namespace qtrain::trainer
