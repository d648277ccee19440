// Qwen2 and Qwen2.5: biases on q, k and v (never on o), and sliding layers from max_window_layers
// on where use_sliding_window is set.
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kQwen25_7b = R"(
  "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
  "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": false, "max_window_layers": 28,
  "hidden_act": "silu", "tie_word_embeddings": false
)";  // Qwen/Qwen2.5-7B

}  // namespace

ModelFamily qwen2_family() {
  ModelFamily family("Qwen2ForCausalLM", "qwen2", "qwen2");
  family.attention_bias = AttentionBias::kQueryKeyValueOnly;
  family.sliding_window = SlidingWindowKeys::kLayerTypes;
  family.gguf.reads_attention_bias = true;
  family.chat_templates = {"chatml"};
  family.add_bench_shape("qwen2.5-7b", kQwen25_7b);
  return family;
}

}  // namespace qtrain::trainer
