// gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases and a learned sink logit per head,
// sliding and full layers alternating (layer_types), YaRN rope; in each layer a biased router whose
// top num_experts_per_tok logits are softmaxed into the chosen experts' weights, experts with biases
// and a clamped SwiGLU. The published checkpoints keep the experts in MXFP4
// (trainer/formats/mxfp4_checkpoint.h), which stays the frozen base.
#include "trainer/model/families/experts.h"
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kGptOss20b = R"(
  "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05, "attention_bias": true, "hidden_act": "silu", "tie_word_embeddings": false,
  "sliding_window": 128, "num_local_experts": 32, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.9,
  "output_router_logits": false, "swiglu_limit": 7.0,
  "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": false, "original_max_position_embeddings": 4096},
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
)";  // openai/gpt-oss-20b

// transformers' GptOssExperts: the SwiGLU's clamp, fixed there whatever config.json's swiglu_limit says.
constexpr double kSwigluLimit = 7.0;

void read_gpt_oss(const HfConfigReader& config, LlamaOptions& llama) {
  read_expert_block(config, llama, config.has("num_local_experts") ? "num_local_experts" : "num_experts",
                    "intermediate_size", 0.001);
  auto& experts = llama.experts;
  if (!config.has("num_experts_per_tok") && config.has("experts_per_token")) {
    experts.experts_per_token = config.positive_int("experts_per_token");  // the published config.json's name
  }
  experts.router = "router";
  experts.biases = true;
  experts.top_k_then_softmax = true;
  experts.normalize_top_k = false;
  experts.swiglu_limit = kSwigluLimit;
  experts.interleaved_gate_up = true;
  // GptOssConfig's defaults: biased attention, and without layer_types every other layer sliding
  // (the first one first).
  llama.attention_bias = llama.output_bias = config.bool_or("attention_bias", true);
  llama.attention_sinks = true;
  if (!config.has("layer_types") && config.has("sliding_window")) {
    llama.sliding_window = config.positive_int("sliding_window");
    llama.sliding_layers.assign(static_cast<size_t>(llama.num_hidden_layers), false);
    for (size_t layer = 0; layer < llama.sliding_layers.size(); ++layer) llama.sliding_layers[layer] = layer % 2 == 0;
  }
  if (!config.has("rope_parameters") && !config.has("rope_scaling")) {
    config.fail("has no rope_parameters (gpt-oss's YaRN settings); give the checkpoint's config.json as published");
  }
}

// llama.cpp's gpt-oss: each expert's width, the window and its layer pattern (every other layer,
// the first sliding: llama.cpp's default of 2).
void add_gpt_oss_metadata(const LlamaOptions& llama, const std::string& prefix, GgufMetadata& metadata) {
  metadata.emplace_back(prefix + "expert_feed_forward_length", static_cast<uint32_t>(llama.experts.intermediate_size));
  metadata.emplace_back(prefix + "attention.sliding_window", static_cast<uint32_t>(llama.sliding_window));
  metadata.emplace_back(prefix + "attention.sliding_window_pattern", static_cast<uint32_t>(2));
}

// What llama.cpp's gpt-oss fixes (llama-model.cpp; src/models/openai-moe.cpp): YaRN with beta 32 / 1,
// sliding and full layers alternating from a sliding first one, untied embeddings.
std::string gpt_oss_llama_cpp_difference(const LlamaOptions& llama) {
  if (llama.rope.type != RopeType::kYarn || llama.rope.beta_fast != 32 || llama.rope.beta_slow != 1) {
    return "a rope other than YaRN with beta_fast 32 and beta_slow 1 (what llama.cpp's 'gpt-oss' runs)";
  }
  for (size_t layer = 0; layer < static_cast<size_t>(llama.num_hidden_layers); ++layer) {
    const bool slides = layer < llama.sliding_layers.size() && llama.sliding_layers[layer];
    if (slides != (layer % 2 == 0)) return "sliding layers other than every other one from the first (llama.cpp's pattern)";
  }
  if (llama.tie_word_embeddings) return "tied embeddings (llama.cpp's 'gpt-oss' needs its own output.weight)";
  return "";
}

}  // namespace

ModelFamily gpt_oss_family() {
  ModelFamily family("GptOssForCausalLM", "gpt_oss", "gpt-oss");
  family.gguf.reads_attention_bias = true;
  family.gguf.reads_sliding_window = true;
  family.gguf.add_metadata = add_gpt_oss_metadata;
  family.gguf.llama_cpp_difference = gpt_oss_llama_cpp_difference;
  family.gguf.layer_tensor_names = {{"mlp.router.", "ffn_gate_inp."},
                                    {"post_attention_layernorm.", "post_attention_norm."},
                                    {"self_attn.sinks", "attn_sinks.weight"}};
  family.sliding_window = SlidingWindowKeys::kLayerTypes;
  family.rope_theta = 150000.0;
  family.read_config = read_gpt_oss;
  family.add_bench_shape("gpt-oss-20b", kGptOss20b);
  return family;
}

}  // namespace qtrain::trainer
