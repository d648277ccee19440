#include "trainer/objectives/preference_eval.h"

#include <algorithm>

#include "trainer/model/batch_inputs.h"
#include "trainer/objectives/pair_log_probs.h"

namespace qtrain::trainer {

namespace {

// The model in eval mode (no dropout) for a pass, back in its mode after.
struct EvalMode {
  explicit EvalMode(LlamaForCausalLMImpl& model) : model(model), was_training(model.is_training()) { model.eval(); }
  ~EvalMode() { model.train(was_training); }
  LlamaForCausalLMImpl& model;
  bool was_training;
};

// Runs `visit(batch on the device, first pair index)` over the pairs, batch_size at a time.
template <typename Visit>
void for_each_batch(const std::vector<data::Example>& pairs, const PairPassOptions& options, const Visit& visit) {
  const auto device = options.device;
  const auto size = static_cast<int64_t>(pairs.size());
  const int64_t batch_size = std::max<int64_t>(options.batch_size, 1);
  int64_t batches = 0;
  for (int64_t first = 0; first < size; first += batch_size) {
    if (options.max_batches > 0 && batches == options.max_batches) break;
    std::vector<const data::Example*> rows;
    for (int64_t index = first; index < std::min(size, first + batch_size); ++index) rows.push_back(&pairs[index]);
    visit(batch_on_device(data::collate(rows, options.pad_id), device), first);
    ++batches;
  }
}

}  // namespace

PreferenceEval evaluate_preference(LlamaForCausalLMImpl& model, const std::vector<data::Example>& pairs,
                                   const PreferenceOptions& preference, const PairPassOptions& options) {
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(model);
  PreferenceEval result;
  const bool needs_reference = objective_row(preference.objective).reference;
  for_each_batch(pairs, options, [&](const data::Batch& batch, int64_t) {
    PairLogProbs reference;
    if (needs_reference) reference = reference_log_probs(model, batch, options.loss, options.packed_attention);
    const auto hidden = model.hidden_states(model_inputs(batch, batch.input_ids.device(), options.packed_attention));
    const auto policy = pair_log_probs(model, hidden, batch, options.loss);
    const auto loss = preference_loss(policy, needs_reference ? &reference : nullptr, preference);
    result.loss_sum += loss.loss.item<double>();
    loss.add_metrics_to(result.metric_sums);
    ++result.batches;
  });
  return result;
}

void compute_reference_log_probs(LlamaForCausalLMImpl& model, std::vector<data::Example>& pairs,
                                 const PairPassOptions& options) {
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(model);
  for (auto& pair : pairs) pair.reference_log_probs.clear();  // computed, not read back
  PairPassOptions every = options;
  every.max_batches = 0;
  for_each_batch(pairs, every, [&](const data::Batch& batch, int64_t first) {
    const auto reference = reference_log_probs(model, batch, options.loss, options.packed_attention);
    const auto chosen = reference.chosen.to(torch::kCPU, torch::kFloat64);
    const auto rejected = reference.rejected.to(torch::kCPU, torch::kFloat64);
    for (int64_t row = 0; row < chosen.size(0); ++row) {
      pairs[static_cast<size_t>(first + row)].reference_log_probs = {chosen[row].item<double>(), rejected[row].item<double>()};
    }
  });
}

}  // namespace qtrain::trainer
