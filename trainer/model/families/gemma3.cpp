// Gemma 3 (its text decoder, gemma3_text): Gemma's block (gemma.h) with RMSNorm on each head's q
// and k, no soft-caps, five sliding layers in six, and a rope of their own for the sliding layers.
#include "trainer/model/families/families.h"
#include "trainer/model/families/gemma.h"

namespace qtrain::trainer {

namespace {

// google/gemma-3-12b-pt's text_config (its config.json is a Gemma3ForConditionalGeneration's),
// with the keys transformers' Gemma3TextConfig defaults written out.
constexpr const char* kGemma3_12b = R"(
  "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
  "rope_local_base_freq": 10000.0, "attention_bias": false, "hidden_activation": "gelu_pytorch_tanh",
  "query_pre_attn_scalar": 256, "attn_logit_softcapping": null, "final_logit_softcapping": null,
  "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": true
)";

// llama.cpp scales the 27B's (62 layers) queries by its hidden size per head, and caps no scores.
std::string gemma3_llama_cpp_difference(const LlamaOptions& llama) {
  return gemma_llama_cpp_difference(llama, "gemma3", 62, /*caps_scores=*/false);
}

}  // namespace

ModelFamily gemma3_family() {
  ModelFamily family =
      gemma_family("Gemma3ForCausalLM", "gemma3_text", "gemma3", /*sliding_pattern=*/6, gemma3_llama_cpp_difference);
  family.query_key_norm = true;
  family.rope_per_layer_type = true;
  family.rope_theta = 1000000.0;  // the full layers'; the sliding ones' is 10k
  // The released checkpoints' activations pass fp16's 65,504 (transformers#36822; Unsloth and
  // onnxruntime-genai move such runs off fp16).
  family.fp16_overflows = true;
  family.gguf.reads_query_key_norm = true;
  family.chat_templates = {"gemma3"};
  family.add_bench_shape("gemma3-12b", kGemma3_12b);
  return family;
}

}  // namespace qtrain::trainer
