#pragma once
// Choosing the next token from a model's logits, with transformers' logits processors, each as
// its definition (transformers/generation/logits_process.py), applied in transformers' order:
//   repetition penalty (greedy too)  ->  temperature  ->  top-k  ->  top-p  (sampling only)
// then the most likely token (greedy) or a draw from softmax(logits) (sampling).
// Logits are [batch, vocab] fp32; a removed token's logit becomes -inf.
#include <torch/torch.h>

#include <cstdint>

namespace qtrain::trainer {

struct SamplingOptions {
  bool do_sample = false;           // false: greedy, the most likely token
  double temperature = 1.0;         // sampling: logits / temperature (> 0)
  int64_t top_k = 50;               // sampling: keep the k most likely tokens (0: all)
  double top_p = 1.0;               // sampling: keep the most likely tokens whose probability sums to top_p (1: all)
  double repetition_penalty = 1.0;  // every token already in the sequence: logit / p if positive, * p if not (1: none)
};

// previous_ids [batch, n] int64: the sequence so far (prompt and generated tokens).
torch::Tensor apply_repetition_penalty(const torch::Tensor& logits, const torch::Tensor& previous_ids, double penalty);
torch::Tensor apply_temperature(const torch::Tensor& logits, double temperature);
// Keeps every token whose logit is at least the k-th largest (ties at the k-th all stay).
torch::Tensor apply_top_k(const torch::Tensor& logits, int64_t top_k);
// Sorted ascending, removes the tokens whose cumulative probability is <= 1 - top_p; the most
// likely token always stays.
torch::Tensor apply_top_p(const torch::Tensor& logits, double top_p);

// All processors that `options` turns on, in order.
torch::Tensor process_logits(const torch::Tensor& logits, const torch::Tensor& previous_ids,
                             const SamplingOptions& options);

// The next token of each row, [batch] int64, on the CPU. Sampling draws with `generator` (a CPU
// generator, so a seed gives the same tokens on every device).
torch::Tensor choose_next_tokens(const torch::Tensor& logits, const torch::Tensor& previous_ids,
                                 const SamplingOptions& options, torch::Generator& generator);

}  // namespace qtrain::trainer
