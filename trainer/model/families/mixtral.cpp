// Mixtral (8x7B, 8x22B): Mistral's attention, and in each layer a router choosing
// num_experts_per_tok of num_local_experts experts, their fp32 weights renormalised to sum to 1.
#include "trainer/model/families/experts.h"
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kMixtral8x7b = R"(
  "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "hidden_act": "silu", "tie_word_embeddings": false,
  "num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": false, "router_aux_loss_coef": 0.02,
  "router_jitter_noise": 0.0
)";  // mistralai/Mixtral-8x7B-v0.1

void read_mixtral(const HfConfigReader& config, LlamaOptions& llama) {
  read_expert_block(config, llama, "num_local_experts", "intermediate_size", 0.001);
  llama.experts.normalize_top_k = true;
  llama.experts.weights_in_fp32 = true;
  llama.experts.router_jitter_noise = config.number_or("router_jitter_noise", 0.0);
  if (llama.experts.router_jitter_noise < 0 || llama.experts.router_jitter_noise >= 1) {
    config.fail("key 'router_jitter_noise' must be in [0, 1), got " + config.value("router_jitter_noise").dump());
  }
}

}  // namespace

ModelFamily mixtral_family() {
  ModelFamily family("MixtralForCausalLM", "mixtral", "llama");
  family.attention_bias = AttentionBias::kNone;
  family.sliding_window = SlidingWindowKeys::kEveryLayer;
  family.read_config = read_mixtral;
  family.expert_names = {"block_sparse_moe", "w1", "w3", "w2"};
  family.gguf = llama_family().gguf;  // llama.cpp runs Mixtral as its llama with experts
  family.chat_templates = {"mistral-v1", "mistral-v3"};
  family.add_bench_shape("mixtral-8x7b", kMixtral8x7b);
  return family;
}

}  // namespace qtrain::trainer
