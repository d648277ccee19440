#pragma once
// A Llama small enough to build in a test: a 97-token vocabulary, 4 query heads over 2 KV heads
// (grouped-query attention), head_dim = hidden / 4, an MLP 1.5x as wide as the hidden state.
#include <torch/torch.h>

#include "data/batching.h"
#include "trainer/model/llama_options.h"

namespace qtrain::testing {

inline trainer::LlamaOptions small_llama_options(int64_t hidden_size, int64_t layers) {
  trainer::LlamaOptions options;
  options.vocab_size = 97;
  options.hidden_size = hidden_size;
  options.intermediate_size = hidden_size * 3 / 2;
  options.num_hidden_layers = layers;
  options.num_attention_heads = 4;
  options.num_key_value_heads = 2;
  options.head_dim = hidden_size / 4;
  return options;
}

// A training micro-batch for it on the CPU: `rows` rows of `length` random tokens, each its own
// labels (every token but a row's first predicted), from torch's global generator.
inline data::Batch small_llama_batch(int64_t rows, int64_t length) {
  data::Batch batch;
  batch.input_ids = torch::randint(97, {rows, length}, torch::kInt64);
  batch.labels = batch.input_ids.clone();
  batch.input_tokens = rows * length;
  batch.predicted_tokens = rows * (length - 1);
  return batch;
}

}  // namespace qtrain::testing
