#pragma once
// A batch of preference pairs through the model: each row holds one pair as two samples (the
// prompt with the chosen completion, then with the rejected one; data/example.h), attention and
// positions restarting at the second, so that both sequences go through one forward pass as TRL
// concatenates them. The log-probability of every next token inside a sequence is taken with
// the loss's own projection (train.fused_loss: over vocabulary tiles, never [tokens, vocab]), and
// summed per completion.
#include <torch/torch.h>

#include "data/batching.h"
#include "trainer/model/attention_mask.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/llama.h"
#include "trainer/objectives/preference_loss.h"

namespace qtrain::trainer {

// `batch` on the model's device (input_ids, labels, sample_ids); `hidden` the model's final states
// for it. With grad mode on, differentiable with respect to hidden.
PairLogProbs pair_log_probs(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const data::Batch& batch,
                            const LossOptions& options);

// The reference's log-probabilities of a batch on the device: precomputed ones
// (batch.reference_log_probs), or a forward pass without a graph with every adapter switched
// off (the base, as TRL's DPOTrainer takes the reference of a peft model) and QAT's observers
// still. The token counts are the batch's.
PairLogProbs reference_log_probs(LlamaForCausalLMImpl& model, const data::Batch& batch, const LossOptions& options,
                                 PackedAttention packed_attention);

// A batch's tensors on `device` (the step moves them there before the model runs).
data::Batch batch_on_device(const data::Batch& batch, torch::Device device);

}  // namespace qtrain::trainer
