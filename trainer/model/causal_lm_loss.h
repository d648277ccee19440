#pragma once
// Next-token cross-entropy with transformers' shift (the logits at t predict the label at t+1),
// in fp32, over chunks of tokens so that the [tokens, vocab] fp32 logits never exist whole.
// Two ways to project a chunk:
//   fused    (train.fused_loss, where lm_head or the tied embeddings are a frozen plain weight)
//            over vocabulary tiles with an online log-sum-exp, its gradient computed in the same
//            pass where the caller knows the loss's gradient (LossOptions::gradient, the training
//            step), else in a second one in backward (trainer/model/fused_linear_cross_entropy.h):
//            no [chunk, vocab] block.
//   logits   each chunk's whole fp32 logits, then cross_entropy; with autograd, each chunk is
//            checkpointed (its logits recomputed in backward). A LoRA'd, fake-quantized or
//            trained projection always takes this path: its weights need autograd's gradients.
#include "data/batching.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

using data::kIgnoreLabel;

struct TokenLoss {
  torch::Tensor loss_sum;  // scalar fp32: sum of the per-token losses
  torch::Tensor tokens;    // scalar int64: how many labels took part
};

struct LossOptions {
  // Tokens projected at once (train.loss_chunk_tokens); <= 0: every token at once (on the
  // logits path, keeping every logit for backward: the plain path).
  int64_t chunk_tokens = 0;
  bool fused = true;            // train.fused_loss; falls back to the logits path where it cannot apply
  int64_t vocabulary_tile = 0;  // fused: columns per tile; 0: fused_loss_tile_columns(chunk, vocab)
  // causal_lm_loss, fused: the gradient loss_sum will get in backward, where the caller knows it
  // (the training step's loss weight); the forward then computes the states' gradient in its one
  // pass over the vocabulary (FusedLossOptions::gradient). 0: backward does.
  double gradient = 0;
};

// hidden [batch, seq, hidden] (the model's final normed states); labels [batch, seq] int64 with
// kIgnoreLabel where no loss is taken. host_labels: the same labels on the host (a batch's, before
// they went to the device), if the caller has them: where at least 1 in 32 targets is ignored (a
// prompt, padding) and some are not, only the others' states are projected, found on the host
// without a device sync. The loss is the same sum (an ignored target adds 0), to the projection's rounding.
TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         const LossOptions& options, const torch::Tensor& host_labels = {});

// The logits path in chunks of chunk_tokens (LossOptions{chunk_tokens, /*fused=*/false}).
TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         int64_t chunk_tokens);

// The log-probability of each target under the model: hidden [batch, seq, hidden], targets
// [batch, seq] (targets[:, t] is predicted from hidden[:, t]; kIgnoreLabel where none is) ->
// [batch, seq] fp32, 0 where ignored. The same two paths and chunks as causal_lm_loss, without
// transformers' shift: the caller lines the targets up (a preference pair's sequences end inside a row).
torch::Tensor token_log_probs(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& targets,
                              const LossOptions& options);

// Whether causal_lm_loss with options.fused takes the fused path for this model now: lm_head
// multiplies by a plain weight (not a LoRA, QAT or LLM.int8 layer) and, with grad mode on,
// nothing of the projection trains.
bool fused_loss_applies(LlamaForCausalLMImpl& model);

// The chunk for train.loss_chunk_tokens 0: about 512 MiB of fp32 logits, a multiple of 256
// tokens, at least 256.
int64_t auto_loss_chunk_tokens(int64_t vocab_size);

}  // namespace qtrain::trainer
