#pragma once
// Autoregressive generation with a key/value cache: the prompt runs through the model once
// (prefill), then each new token alone, its keys and values appended to the cache
// (trainer/model/llama.h), until an end-of-sequence token or max_new_tokens. The next token is chosen
// as transformers' generate() chooses it (trainer/model/logits_processors.h).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "trainer/model/attention_backends.h"
#include "trainer/model/llama.h"
#include "trainer/model/logits_processors.h"

namespace qtrain::trainer {

struct GenerationOptions {
  int64_t max_new_tokens = 256;
  SamplingOptions sampling;
  std::vector<int64_t> eos_token_ids;  // generation stops after any of them (it is kept)
  uint64_t seed = 0;                   // of the sampling generator
};

struct GenerationResult {
  std::vector<int64_t> tokens;  // the new tokens, the end-of-sequence token included
  bool stopped_at_eos = false;
  double prefill_seconds = 0;   // the prompt's forward pass and the first token
  double decode_seconds = 0;    // every later token
  // Decoding speed: tokens after the first per second of decode_seconds (0 with one token).
  double decode_tokens_per_second() const;
};

// Called with each new token as soon as it is chosen (streaming).
using TokenCallback = std::function<void(int64_t token)>;


// Continues `prompt_ids` (non-empty) with `model` on its device, without gradients.
GenerationResult generate(LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt_ids,
                          const GenerationOptions& options, const TokenCallback& on_token = nullptr);

}  // namespace qtrain::trainer
