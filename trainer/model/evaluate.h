#pragma once
// Held-out loss and perplexity of a causal LM over examples.
#include <vector>

#include "data/example.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

struct EvalOptions {
  int64_t batch_size = 8;
  int64_t max_batches = 0;           // 0 = every example
  int64_t loss_chunk_tokens = 4096;  // tokens projected to the vocabulary at once
  // Over vocabulary tiles, never a [chunk, vocab] fp32 block (causal_lm_loss's fused path; any
  // lm_head whose forward is a plain matmul qualifies, since nothing is differentiated here).
  bool fused_loss = true;
};

struct EvalResult {
  double loss = 0;        // mean next-token cross-entropy over every predicted token (nats)
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // predicted tokens
  double seconds = 0;
  double tokens_per_second = 0;  // input tokens through the model per second
};

// Examples are right-padded within a batch, in order; padding and masked labels take no part
// in the loss.
EvalResult evaluate(LlamaForCausalLMImpl& model, const std::vector<data::Example>& examples,
                    const EvalOptions& options);

}  // namespace qtrain::trainer
