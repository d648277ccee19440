// Gemma 2: Gemma's block (gemma.h) with soft-capped scores and logits, and sliding and full
// layers alternating.
#include "trainer/model/families/families.h"
#include "trainer/model/families/gemma.h"

namespace qtrain::trainer {

namespace {

// transformers' Gemma2Config ties the embeddings by default, and the published config.json leaves
// tie_word_embeddings out: it is written here.
constexpr const char* kGemma2_9b = R"(
  "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "max_position_embeddings": 8192,
  "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "attention_bias": false, "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
  "final_logit_softcapping": 30.0, "sliding_window": 4096, "tie_word_embeddings": true
)";  // google/gemma-2-9b

// llama.cpp's sliding-window pattern for the layers of `llama`: the p for which layer il slides
// exactly when il % p < p - 1 (attention.sliding_window_pattern); 0 when no p gives its layers.
int64_t sliding_pattern_of(const LlamaOptions& llama) {
  for (int64_t pattern = 1; pattern <= llama.num_hidden_layers + 1; ++pattern) {
    bool matches = true;
    for (int64_t layer = 0; layer < llama.num_hidden_layers && matches; ++layer) {
      matches = llama.layer_slides(layer) == (layer % pattern < pattern - 1);
    }
    if (matches) return pattern;
  }
  return 0;
}

// llama.cpp scales the 27B's (46 layers) queries by its hidden size per head.
std::string gemma2_llama_cpp_difference(const LlamaOptions& llama) {
  return gemma_llama_cpp_difference(llama, "gemma2", 46, /*caps_scores=*/true);
}

}  // namespace

void read_gemma_block(const HfConfigReader& reader, LlamaOptions& llama) {
  llama.norm_style = NormStyle::kUnitOffset;
  llama.sandwich_norms = true;
  llama.scale_embeddings = true;
  llama.query_pre_attn_scalar = reader.number_or("query_pre_attn_scalar", 256.0);
  if (llama.query_pre_attn_scalar <= 0) reader.fail("key 'query_pre_attn_scalar' must be positive");
  // The soft-caps have family defaults in transformers (Gemma 2: 50 and 30, Gemma 3: none), so a
  // config must say them: absent is an error, null is none.
  const auto softcap = [&](const std::string& key) {
    if (!reader.object().contains(key)) {
      reader.fail("is missing the key '" + key + "' (Gemma 2 caps at 50 / 30 and Gemma 3 not at all: write the number, or null for none)");
    }
    const double cap = reader.number_or(key, 0.0);
    if (cap < 0) reader.fail("key '" + key + "' must be positive or null, got " + std::to_string(cap));
    return cap;
  };
  llama.attention_softcap = softcap("attn_logit_softcapping");
  llama.final_logit_softcap = softcap("final_logit_softcapping");
  if (reader.bool_or("use_bidirectional_attention", false)) {
    reader.fail("use_bidirectional_attention is true (an encoder-style Gemma); qtrain trains causal decoders only");
  }
}

void add_gemma_metadata(const LlamaOptions& llama, const std::string& key, GgufMetadata& metadata) {
  if (llama.sliding_window > 0) {
    metadata.emplace_back(key + "attention.sliding_window", static_cast<uint32_t>(llama.sliding_window));
    metadata.emplace_back(key + "attention.sliding_window_pattern", static_cast<uint32_t>(sliding_pattern_of(llama)));
  }
  if (llama.attention_softcap > 0) metadata.emplace_back(key + "attn_logit_softcapping", static_cast<float>(llama.attention_softcap));
  if (llama.final_logit_softcap > 0) {
    metadata.emplace_back(key + "final_logit_softcapping", static_cast<float>(llama.final_logit_softcap));
  }
  if (llama.sliding_rope) metadata.emplace_back(key + "rope.freq_base_swa", static_cast<float>(llama.sliding_rope->theta));
}

std::string gemma_llama_cpp_difference(const LlamaOptions& llama, const std::string& name, int64_t large_model_layers,
                                       bool caps_scores) {
  const bool large = llama.num_hidden_layers == large_model_layers;
  const double scalar = large ? static_cast<double>(llama.hidden_size / llama.num_attention_heads)
                              : static_cast<double>(llama.head_dim);
  if (llama.query_pre_attn_scalar != scalar) {
    return "query_pre_attn_scalar " + std::to_string(llama.query_pre_attn_scalar) + ", where llama.cpp's '" + name +
           "' scales the queries by " + std::to_string(scalar) + "^-1/2 for this shape";
  }
  if (llama.activation != Activation::kGeluTanh) return "a hidden_activation other than gelu_pytorch_tanh";
  if (!llama.tie_word_embeddings) return "untied embeddings (llama.cpp's '" + name + "' projects with token_embd)";
  // Sliding layers: those with il % pattern < pattern - 1, as llama.cpp's swa pattern sets them.
  if (llama.sliding_window > 0 && sliding_pattern_of(llama) == 0) {
    return "sliding layers in no pattern llama.cpp sets (all but every p-th layer)";
  }
  if (!caps_scores && llama.attention_softcap > 0) return "soft-capped scores (llama.cpp's " + name + " caps none)";
  if (llama.sliding_rope && llama.sliding_rope->type != RopeType::kDefault) {
    return "a scaled rope on the sliding layers (llama.cpp scales the full layers' only)";
  }
  return "";
}

ModelFamily gemma_family(std::string architecture, std::string model_type, std::string gguf_name, int64_t sliding_pattern,
                         std::string (*llama_cpp_difference)(const LlamaOptions& llama)) {
  ModelFamily family(std::move(architecture), std::move(model_type), std::move(gguf_name));
  family.sliding_window = SlidingWindowKeys::kLayerTypesOrPattern;
  family.sliding_pattern = sliding_pattern;
  family.activation_key = "hidden_activation";  // its hidden_act, where present, is ignored
  family.read_config = read_gemma_block;
  family.gguf.reads_sliding_window = true;
  family.gguf.norm_weights_plus_one = true;
  // llama.cpp names the attention's output norm post_attention_norm and the MLP's input norm
  // ffn_norm (gguf-py: ATTN_POST_NORM, FFN_PRE_NORM).
  family.gguf.layer_tensor_names = {
      {"post_attention_layernorm.", "post_attention_norm."},
      {"pre_feedforward_layernorm.", "ffn_norm."},
      {"post_feedforward_layernorm.", "post_ffw_norm."},
  };
  family.gguf.add_metadata = add_gemma_metadata;
  family.gguf.llama_cpp_difference = llama_cpp_difference;
  return family;
}

ModelFamily gemma2_family() {
  ModelFamily family =
      gemma_family("Gemma2ForCausalLM", "gemma2", "gemma2", /*sliding_pattern=*/2, gemma2_llama_cpp_difference);
  family.chat_templates = {"gemma"};
  family.add_bench_shape("gemma2-9b", kGemma2_9b);
  return family;
}

}  // namespace qtrain::trainer
