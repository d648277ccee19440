// Mistral (7B v0.1 to v0.3, Ministral, Nemo): Llama without attention biases, and a sliding window
// over every layer where config.json sets one (7B v0.1: 4096 keys; v0.2 and later: null).
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kMistral7b = R"(
  "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "hidden_act": "silu", "tie_word_embeddings": false
)";  // mistralai/Mistral-7B-v0.3

}  // namespace

ModelFamily mistral_family() {
  ModelFamily family("MistralForCausalLM", "mistral", "llama");
  family.attention_bias = AttentionBias::kNone;  // transformers' Mistral has none, whatever attention_bias says
  family.sliding_window = SlidingWindowKeys::kEveryLayer;
  family.gguf = llama_family().gguf;  // llama.cpp runs Mistral as its llama
  family.chat_templates = {"mistral-v1", "mistral-v3"};
  family.add_bench_shape("mistral-7b", kMistral7b);
  return family;
}

}  // namespace qtrain::trainer
