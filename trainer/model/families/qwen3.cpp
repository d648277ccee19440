// Qwen3: Qwen2's sliding-window keys, RMSNorm on each head's q and k, and biases only where
// attention_bias says.
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kQwen3_8b = R"(
  "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": null, "attention_bias": false,
  "sliding_window": null, "use_sliding_window": false, "max_window_layers": 36, "hidden_act": "silu",
  "tie_word_embeddings": false
)";  // Qwen/Qwen3-8B

}  // namespace

ModelFamily qwen3_family() {
  ModelFamily family("Qwen3ForCausalLM", "qwen3", "qwen3");
  family.query_key_norm = true;
  family.sliding_window = SlidingWindowKeys::kLayerTypes;
  family.gguf.reads_query_key_norm = true;
  family.chat_templates = {"qwen3", "qwen3-instruct", "qwen3-thinking"};
  family.add_bench_shape("qwen3-8b", kQwen3_8b);
  return family;
}

}  // namespace qtrain::trainer
