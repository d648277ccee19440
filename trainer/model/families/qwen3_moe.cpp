// Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in each layer a router
// choosing num_experts_per_tok of num_experts experts, their weights renormalised where
// norm_topk_prob says; layers in mlp_only_layers, or off every decoder_sparse_step-th, keep the
// dense MLP.
#include <algorithm>

#include "trainer/model/families/experts.h"
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kQwen3_30b_a3b = R"(
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": null, "attention_bias": false,
  "sliding_window": null, "use_sliding_window": false, "max_window_layers": 48, "hidden_act": "silu",
  "tie_word_embeddings": false, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
  "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": false,
  "router_aux_loss_coef": 0.001
)";  // Qwen/Qwen3-30B-A3B

void read_qwen3_moe(const HfConfigReader& config, LlamaOptions& llama) {
  // transformers 5.17 writes num_local_experts where the published configs have num_experts.
  read_expert_block(config, llama, config.has("num_experts") ? "num_experts" : "num_local_experts",
                    "moe_intermediate_size", 0.001);
  llama.experts.normalize_top_k = config.bool_or("norm_topk_prob", false);
  // As transformers' Qwen3MoeDecoderLayer: experts where the layer is not in mlp_only_layers and
  // (layer + 1) is a multiple of decoder_sparse_step.
  const int64_t step = config.positive_int_or("decoder_sparse_step", 1);
  std::vector<int64_t> dense;
  if (config.has("mlp_only_layers")) {
    const auto& listed = config.value("mlp_only_layers");
    if (!listed.is_array()) config.fail("key 'mlp_only_layers' must be a list of layer indices, got " + listed.dump());
    for (const auto& layer : listed) {
      if (!layer.is_number_integer()) config.fail("key 'mlp_only_layers' must list layer indices, got " + listed.dump());
      dense.push_back(layer.get<int64_t>());
    }
  }
  // Qwen3MoeConfig: use_sliding_window puts every layer (no max_window_layers) in the window.
  if (config.bool_or("use_sliding_window", false) && config.has("sliding_window")) {
    llama.sliding_window = config.positive_int("sliding_window");
    llama.sliding_layers.assign(static_cast<size_t>(llama.num_hidden_layers), true);
  }
  llama.dense_layers.assign(static_cast<size_t>(llama.num_hidden_layers), false);
  for (int64_t layer = 0; layer < llama.num_hidden_layers; ++layer) {
    const bool listed = std::find(dense.begin(), dense.end(), layer) != dense.end();
    llama.dense_layers[static_cast<size_t>(layer)] = listed || (layer + 1) % step != 0;
  }
}

// llama.cpp's qwen3moe reads each expert's width apart from the dense feed_forward_length.
void add_qwen3_moe_metadata(const LlamaOptions& llama, const std::string& prefix, GgufMetadata& metadata) {
  metadata.emplace_back(prefix + "expert_feed_forward_length", static_cast<uint32_t>(llama.experts.intermediate_size));
}

}  // namespace

void read_expert_block(const HfConfigReader& config, LlamaOptions& llama, const std::string& experts_key,
                       const std::string& intermediate_key, double aux_loss_default) {
  auto& experts = llama.experts;
  llama.feed_forward = FeedForwardKind::kExperts;
  experts.num_experts = config.positive_int(experts_key);
  experts.experts_per_token = config.positive_int("num_experts_per_tok");
  if (experts.experts_per_token > experts.num_experts) {
    config.fail("num_experts_per_tok (" + std::to_string(experts.experts_per_token) + ") exceeds " + experts_key + " (" +
                std::to_string(experts.num_experts) + ")");
  }
  experts.intermediate_size = config.positive_int(intermediate_key);
  experts.output_router_logits = config.bool_or("output_router_logits", false);
  experts.router_aux_loss_coef = config.number_or("router_aux_loss_coef", aux_loss_default);
}

ModelFamily qwen3_moe_family() {
  ModelFamily family("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe");
  family.query_key_norm = true;
  family.gguf.reads_query_key_norm = true;
  family.gguf.add_metadata = add_qwen3_moe_metadata;
  family.read_config = read_qwen3_moe;
  family.chat_templates = {"qwen3", "qwen3-instruct", "qwen3-thinking"};
  family.add_bench_shape("qwen3-30b-a3b", kQwen3_30b_a3b);
  return family;
}

}  // namespace qtrain::trainer
