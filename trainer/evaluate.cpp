#include "trainer/evaluate.h"

#include <chrono>
#include <cmath>

#include "kernels/error.h"
#include "trainer/batch_inputs.h"
#include "trainer/causal_lm_loss.h"

namespace qtrain::trainer {

EvalResult evaluate(LlamaForCausalLMImpl& model, const std::vector<data::Example>& examples,
                    const EvalOptions& options) {
  if (examples.empty()) throw Error(ErrorCode::kData, "evaluation data holds no example with a token to predict");
  if (options.batch_size < 1) throw Error(ErrorCode::kRecipe, "batch size must be at least 1");
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.model->embed_tokens->weight.device();
  const auto start = std::chrono::steady_clock::now();

  double loss_sum = 0;
  int64_t predicted_tokens = 0;
  int64_t input_tokens = 0;
  int64_t batches = 0;
  for (size_t first = 0; first < examples.size(); first += static_cast<size_t>(options.batch_size)) {
    if (options.max_batches > 0 && batches == options.max_batches) break;
    const size_t last = std::min(examples.size(), first + static_cast<size_t>(options.batch_size));
    std::vector<const data::Example*> rows;
    for (size_t index = first; index < last; ++index) rows.push_back(&examples[index]);
    const auto batch = data::collate(rows);
    input_tokens += batch.input_tokens;
    auto labels = batch.labels.to(device);
    // Right padding after a causal mask never reaches the real tokens before it.
    auto hidden = model.hidden_states(model_inputs(batch, device));
    auto loss = causal_lm_loss(model, hidden, labels, options.loss_chunk_tokens);
    loss_sum += loss.loss_sum.item<double>();
    predicted_tokens += loss.tokens.item<int64_t>();
    ++batches;
  }
  if (was_training) model.train();

  EvalResult result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.tokens = predicted_tokens;
  result.loss = loss_sum / static_cast<double>(std::max<int64_t>(predicted_tokens, 1));
  result.perplexity = std::exp(result.loss);
  result.tokens_per_second = static_cast<double>(input_tokens) / std::max(result.seconds, 1e-9);
  return result;
}

}  // namespace qtrain::trainer
