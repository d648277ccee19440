#pragma once
// Parameter counts and the memory a QLoRA / LoRA / full run needs for its weights and
// trainable state, from the model's shape alone (what `qtrain inspect` reports).
#include <string>
#include <vector>

#include "trainer/llama.h"

namespace qtrain::trainer {

struct LlamaParameterCounts {
  int64_t total = 0;
  int64_t projections = 0;  // the 7 linear layers of every decoder layer (what QLoRA quantizes)
  int64_t embeddings = 0;   // embed_tokens (+ lm_head when untied)
  int64_t norms = 0;
  int64_t lora = 0;         // LoRA A and B on the 7 projections at the given rank
};

LlamaParameterCounts llama_parameter_counts(const LlamaOptions& options, int64_t lora_rank);

struct MemoryEstimate {
  std::string mode;            // qlora, lora, full
  double frozen_bytes = 0;     // base weights that do not train
  int64_t trainable_parameters = 0;
  double trainable_bytes = 0;  // fp32 weights + grads + AdamW's two moments (16 bytes each)
};

// qlora: NF4 projections with double-quantized absmax (4.127 bits each), bf16 rest;
// lora: bf16 base; full: every parameter trains.
std::vector<MemoryEstimate> training_memory_estimates(const LlamaParameterCounts& counts);

}  // namespace qtrain::trainer
