// Llama (Llama 2, Llama 3, 3.1, 3.2): the decoder the other families change.
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

// The published config.json of each bench shape, less what leaves the work unchanged (ids, dtype,
// initializer_range; Llama 3.2's rope_scaling, which changes the rotary tables' values only).
constexpr const char* kLlama3_8b = R"(
  "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "rope_scaling": null, "attention_bias": false, "hidden_act": "silu",
  "tie_word_embeddings": false
)";  // meta-llama/Meta-Llama-3-8B
constexpr const char* kLlama3_70b = R"(
  "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
  "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "rope_scaling": null, "attention_bias": false, "hidden_act": "silu",
  "tie_word_embeddings": false
)";  // meta-llama/Meta-Llama-3-70B
constexpr const char* kLlama3_1b = R"(
  "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "attention_bias": false, "hidden_act": "silu",
  "tie_word_embeddings": true
)";  // meta-llama/Llama-3.2-1B
// The shape of tests' tiny-llama fixture, with a 688-wide MLP (the fixture's is 768).
constexpr const char* kTiny = R"(
  "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": false
)";

}  // namespace

ModelFamily llama_family() {
  ModelFamily family("LlamaForCausalLM", "llama", "llama");
  family.gguf.rope_rows_reordered = true;
  family.gguf.reads_attention_bias = true;
  family.chat_templates = {"llama3"};
  family.add_bench_shape("llama3-8b", kLlama3_8b);
  family.add_bench_shape("llama3-1b", kLlama3_1b);
  family.add_bench_shape("llama3-70b", kLlama3_70b);
  family.add_bench_shape("tiny", kTiny);
  return family;
}

}  // namespace qtrain::trainer
