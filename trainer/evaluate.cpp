#include "trainer/evaluate.h"

#include <chrono>
#include <cmath>

#include "kernels/error.h"
#include "trainer/causal_lm_loss.h"

namespace qtrain::trainer {

EvalResult evaluate(LlamaForCausalLMImpl& model, const std::vector<std::vector<int64_t>>& sequences,
                    const EvalOptions& options) {
  if (sequences.empty()) throw Error("evaluation data holds no sequence of two or more tokens");
  if (options.batch_size < 1) throw Error("batch size must be at least 1");
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.model->embed_tokens->weight.device();
  const auto start = std::chrono::steady_clock::now();

  double loss_sum = 0;
  int64_t predicted_tokens = 0;
  int64_t input_tokens = 0;
  int64_t batches = 0;
  for (size_t first = 0; first < sequences.size(); first += static_cast<size_t>(options.batch_size)) {
    if (options.max_batches > 0 && batches == options.max_batches) break;
    const size_t last = std::min(sequences.size(), first + static_cast<size_t>(options.batch_size));
    auto batch = data::collate(sequences, first, last);
    input_tokens += batch.input_tokens;
    auto input_ids = batch.input_ids.to(device);
    auto labels = batch.labels.to(device);
    // Right padding after a causal mask never reaches the real tokens before it.
    auto hidden = model.hidden_states(LlamaInputs{input_ids, {}, {}});
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
