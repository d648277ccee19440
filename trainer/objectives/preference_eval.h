#pragma once
// A preference objective over held-out pairs, or a pass that computes the reference's
// log-probabilities of every pair once (dpo.precompute_reference): batches of pairs in order,
// without a graph, the model in eval mode for the pass.
#include <string>
#include <utility>
#include <vector>

#include "data/example.h"
#include "trainer/model/attention_mask.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/llama.h"
#include "trainer/objectives/preference_loss.h"

namespace qtrain::trainer {

struct PairPassOptions {
  torch::Device device{torch::kCPU};  // the run's (the model's layers'; its embeddings may stay on the host)
  int64_t batch_size = 1;
  int64_t max_batches = 0;  // 0: every pair
  LossOptions loss;
  PackedAttention packed_attention = PackedAttention::kSpans;
  int64_t pad_id = 0;
};

struct PreferenceEval {
  double loss_sum = 0;  // summed over the batches (each batch's loss is its mean)
  int64_t batches = 0;
  std::vector<std::pair<std::string, double>> metric_sums;  // summed over the batches alike
};

PreferenceEval evaluate_preference(LlamaForCausalLMImpl& model, const std::vector<data::Example>& pairs,
                                   const PreferenceOptions& preference, const PairPassOptions& options);

// Sets every pair's reference_log_probs: the model's own, with the adapters off (the model as
// loaded, when it trains the full weights and has not stepped yet).
void compute_reference_log_probs(LlamaForCausalLMImpl& model, std::vector<data::Example>& pairs,
                                 const PairPassOptions& options);

}  // namespace qtrain::trainer
