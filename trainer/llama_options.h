#pragma once
// The shape and rotary-embedding settings of a Llama model, as config.json gives them
// (trainer/hf_config.h reads them). Plain data, free of LibTorch.
#include <cstdint>

namespace qtrain::trainer {

enum class RopeType { kDefault, kLinear, kDynamic, kLlama3 };

struct RopeOptions {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                   // linear, dynamic, llama3
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  int64_t original_max_position_embeddings = 0;  // llama3, dynamic (0 = max_position_embeddings)
};

struct LlamaOptions {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool attention_bias = false;
  bool mlp_bias = false;
  bool tie_word_embeddings = false;
  RopeOptions rope;
};

}  // namespace qtrain::trainer
