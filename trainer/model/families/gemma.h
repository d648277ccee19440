#pragma once
// What Gemma 2 and Gemma 3 share (defined in gemma2.cpp): Gemma's block (llama_options.h), read
// from config.json, written as llama.cpp's keys, and checked against what llama.cpp fixes.
#include <cstdint>
#include <string>

#include "trainer/model/config_reader.h"
#include "trainer/model/model_families.h"

namespace qtrain::trainer {

// (1 + w) RMSNorm, sandwich norms, scaled embeddings, and the keys query_pre_attn_scalar,
// attn_logit_softcapping, final_logit_softcapping; bidirectional attention is refused.
void read_gemma_block(const HfConfigReader& config, LlamaOptions& llama);

// The sliding window and its layer pattern, the soft-caps and the sliding layers' theta.
void add_gemma_metadata(const LlamaOptions& llama, const std::string& prefix, GgufMetadata& metadata);

// What llama.cpp's Gemma architecture `name` fixes where transformers reads config.json, or "":
// its query scale (1 / sqrt(hidden / heads) for models of `large_model_layers` layers, the 27B
// ones, else 1 / sqrt(head_dim)), GELU, tied embeddings, a sliding-layer pattern, no scaled rope on
// the sliding layers, and, unless `caps_scores`, no soft-capped scores.
std::string gemma_llama_cpp_difference(const LlamaOptions& llama, const std::string& name, int64_t large_model_layers,
                                       bool caps_scores);

// The row both start from: Gemma's block (read_gemma_block), layer_types or else all but every
// `sliding_pattern`-th layer sliding, hidden_activation, and llama.cpp's (1 + w) norms, Gemma keys
// (add_gemma_metadata), sandwich norms' tensor names and `llama_cpp_difference`.
ModelFamily gemma_family(std::string architecture, std::string model_type, std::string gguf_name, int64_t sliding_pattern,
                         std::string (*llama_cpp_difference)(const LlamaOptions& llama));

}  // namespace qtrain::trainer
