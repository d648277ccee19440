#pragma once
// A Llama small enough to build in a test: a 97-token vocabulary, 4 query heads over 2 KV heads
// (grouped-query attention), head_dim = hidden / 4, an MLP 1.5x as wide as the hidden state.
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

}  // namespace qtrain::testing
