#pragma once
// Next-token cross-entropy with transformers' shift (the logits at t predict the label at t+1),
// in fp32, computed over chunks of tokens so the [tokens, vocab] fp32 logits never exist whole:
// with autograd, each chunk is checkpointed (its logits are recomputed in backward), so in
// training too only one chunk's logits exist at a time.
#include "data/batching.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

using data::kIgnoreLabel;

struct TokenLoss {
  torch::Tensor loss_sum;  // scalar fp32: sum of the per-token losses
  torch::Tensor tokens;    // scalar int64: how many labels took part
};

// hidden [batch, seq, hidden] (the model's final normed states); labels [batch, seq] int64 with
// kIgnoreLabel where no loss is taken. chunk_tokens <= 0 projects every token at once (and
// keeps every logit for backward: the plain path).
TokenLoss causal_lm_loss(LlamaForCausalLMImpl& model, const torch::Tensor& hidden, const torch::Tensor& labels,
                         int64_t chunk_tokens);

// The chunk for train.loss_chunk_tokens 0: about 512 MiB of fp32 logits, a multiple of 256
// tokens, at least 256.
int64_t auto_loss_chunk_tokens(int64_t vocab_size);

}  // namespace qtrain::trainer
