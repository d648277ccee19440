#include "trainer/objectives/pair_log_probs.h"

#include "kernels/error.h"
#include "qat/adapter_switch.h"
#include "qat/qat_linear.h"
#include "trainer/model/batch_inputs.h"

namespace qtrain::trainer {

namespace {

using torch::indexing::None;
using torch::indexing::Slice;

// What each position predicts in a batch of pairs: the next token of the same sequence.
struct PairTargets {
  torch::Tensor targets;     // [rows, seq] int64: the next token inside the sequence, else kIgnoreLabel
  torch::Tensor chosen;      // [rows, seq] bool: the target is a token of the chosen completion
  torch::Tensor rejected;    // [rows, seq] bool: ... of the rejected completion
  torch::Tensor chosen_any;  // [rows, seq] bool: the target is any token of the chosen sequence
};

PairTargets pair_targets(const data::Batch& batch) {
  if (!batch.sample_ids.defined()) {
    throw Error(ErrorCode::kData, "a preference objective needs rows of preference pairs (data.format preference)");
  }
  const auto& ids = batch.input_ids;
  const auto& samples = batch.sample_ids;
  const auto current = samples.index({Slice(), Slice(None, -1)});
  const auto next = samples.index({Slice(), Slice(1, None)});
  const auto inside = next.eq(current).logical_and(next.ge(0));
  const auto learned = batch.labels.index({Slice(), Slice(1, None)}).ne(kIgnoreLabel).logical_and(inside);
  PairTargets result;
  result.targets = torch::full_like(ids, kIgnoreLabel);
  result.targets.index_put_({Slice(), Slice(None, -1)},
                            torch::where(inside, ids.index({Slice(), Slice(1, None)}), kIgnoreLabel));
  const auto pad_column = torch::zeros({ids.size(0), 1}, samples.options().dtype(torch::kBool));
  result.chosen = torch::cat({learned.logical_and(current.eq(0)), pad_column}, 1);
  result.rejected = torch::cat({learned.logical_and(current.eq(1)), pad_column}, 1);
  result.chosen_any = torch::cat({inside.logical_and(current.eq(0)), pad_column}, 1);
  return result;
}

torch::Tensor masked_row_sums(const torch::Tensor& log_probs, const torch::Tensor& mask) {
  return torch::where(mask, log_probs, 0.0).sum(1);
}

PairLogProbs sums_from(const torch::Tensor& log_probs, const PairTargets& targets, bool sequence_nll) {
  PairLogProbs result;
  result.chosen = masked_row_sums(log_probs, targets.chosen);
  result.rejected = masked_row_sums(log_probs, targets.rejected);
  result.chosen_tokens = targets.chosen.sum(1).to(torch::kFloat32);
  result.rejected_tokens = targets.rejected.sum(1).to(torch::kFloat32);
  if (sequence_nll) {
    result.chosen_sequence_nll = -torch::where(targets.chosen_any, log_probs, 0.0).sum();
    result.chosen_sequence_tokens = targets.chosen_any.sum().to(torch::kFloat32);
  }
  return result;
}

}  // namespace

data::Batch batch_on_device(const data::Batch& batch, torch::Device device) {
  data::Batch moved = batch;
  moved.input_ids = batch.input_ids.to(device);
  moved.labels = batch.labels.to(device);
  if (batch.position_ids.defined()) moved.position_ids = batch.position_ids.to(device);
  if (batch.sample_ids.defined()) moved.sample_ids = batch.sample_ids.to(device);
  if (batch.reference_log_probs.defined()) moved.reference_log_probs = batch.reference_log_probs.to(device);
  return moved;
}

PairLogProbs pair_log_probs(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const data::Batch& batch,
                            const LossOptions& options) {
  const auto targets = pair_targets(batch);
  const auto log_probs = token_log_probs(model, hidden, targets.targets, options);
  return sums_from(log_probs, targets, /*sequence_nll=*/true);
}

PairLogProbs reference_log_probs(LlamaForCausalLMImpl& model, const data::Batch& batch, const LossOptions& options,
                                 PackedAttention packed_attention) {
  const auto targets = pair_targets(batch);
  if (batch.reference_log_probs.defined()) {
    PairLogProbs result;
    const auto precomputed = batch.reference_log_probs.to(torch::kFloat32);
    result.chosen = precomputed.select(1, 0);
    result.rejected = precomputed.select(1, 1);
    result.chosen_tokens = targets.chosen.sum(1).to(torch::kFloat32);
    result.rejected_tokens = targets.rejected.sum(1).to(torch::kFloat32);
    return result;
  }
  torch::NoGradGuard no_grad;
  qat::AdaptersOff adapters_off;
  // The reference must not move a QAT run's observed ranges.
  qat::set_observer_enabled(model, false);
  struct ObserversBack {
    LlamaForCausalLMImpl& model;
    ~ObserversBack() { qat::set_observer_enabled(model, true); }
  } observers_back{model};
  // (The step begins the router's statistics of a mixture of experts after this pass.)
  const auto hidden = model.hidden_states(model_inputs(batch, batch.input_ids.device(), packed_attention));
  return sums_from(token_log_probs(model, hidden, targets.targets, options), targets, /*sequence_nll=*/false);
}

}  // namespace qtrain::trainer
