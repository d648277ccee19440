// Phi-3, Phi-3.5 and Phi-4(-mini): q, k and v from one projection and gate and up from another,
// partial rotary and longrope; Phi-3-mini slides over 2047 keys in every layer.
#include "trainer/model/config_reader.h"
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

// microsoft/Phi-4-mini-instruct's config.json less its longrope rope_scaling (the factors change
// the rotary tables' values, not the work) and its sliding_window of 262,144 keys (longer than
// any sequence it could see).
constexpr const char* kPhi4Mini = R"(
  "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
  "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
  "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "partial_rotary_factor": 0.75, "attention_bias": false, "hidden_act": "silu", "embd_pdrop": 0.0,
  "resid_pdrop": 0.0, "attention_dropout": 0.0, "tie_word_embeddings": true
)";

// Fused projections, and dropout keys that must be off (qtrain trains without them).
void read_phi3_block(const HfConfigReader& reader, LlamaOptions& llama) {
  llama.fused_projections = true;
  for (const char* key : {"embd_pdrop", "resid_pdrop", "attention_dropout"}) {
    if (reader.number_or(key, 0.0) != 0.0) {
      reader.fail(std::string("key '") + key + "' is " + reader.value(key).dump() +
                  "; qtrain implements Phi-3 without dropout in the model (set it to 0.0; LoRA has its own lora.dropout)");
    }
  }
}

}  // namespace

ModelFamily phi3_family() {
  ModelFamily family("Phi3ForCausalLM", "phi3", "phi3");
  family.attention_bias = AttentionBias::kNone;
  family.sliding_window = SlidingWindowKeys::kEveryLayer;
  // transformers' Phi3Config reads these older names of longrope as longrope.
  family.rope_type_aliases = {{"su", "longrope"}, {"yarn", "longrope"}};
  family.read_config = read_phi3_block;
  family.gguf.reads_rope_factors = true;
  // llama.cpp sets token attributes by general.name: a name holding "phi3" or "phi-3" makes it look
  // up Phi-3's sentencepiece tokens, and a vocabulary without one of them fails to load.
  family.gguf.general_name_rule = {{"phi3", "phi-3"}, {"</s>", "<unk>", "<s>", "<|endoftext|>"}, "phi_3"};
  family.chat_templates = {"phi3", "phi3.5", "phi4-mini"};
  family.add_bench_shape("phi4-mini", kPhi4Mini);
  return family;
}

}  // namespace qtrain::trainer
