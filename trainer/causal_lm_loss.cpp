#include "trainer/causal_lm_loss.h"

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

  TokenLoss result;
  result.loss_sum = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
  for (int64_t begin = 0; begin < total; begin += chunk_tokens) {
    const int64_t end = std::min(total, begin + chunk_tokens);
    auto logits = model.logits(predicting.index({Slice(begin, end)})).to(torch::kFloat32);
    result.loss_sum = result.loss_sum +
                      F::cross_entropy(logits, targets.index({Slice(begin, end)}),
                                       F::CrossEntropyFuncOptions().ignore_index(kIgnoreLabel).reduction(torch::kSum));
  }
  result.tokens = targets.ne(kIgnoreLabel).sum();
  return result;
}

}  // namespace qtrain::trainer
