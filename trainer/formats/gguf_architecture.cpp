#include "trainer/formats/gguf_architecture.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "data/text_affixes.h"
#include "data/tokenizer.h"
#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

using data::starts_with;

// llama.cpp's names for a decoder's tensors that every architecture shares (gguf-py's
// tensor_mapping.py: MODEL_ARCH.LLAMA, QWEN2, QWEN3, PHI3); GgufArchitecture::layer_tensor_names
// come first. Fused projections stay fused: attn_qkv, and ffn_up holding gate's rows then up's,
// which llama.cpp's SwiGLU splits in that order. Each is {Hugging Face prefix, GGUF prefix}.
constexpr std::pair<const char*, const char*> kModelTensors[] = {
    {"model.embed_tokens.", "token_embd."},
    {"model.norm.", "output_norm."},
    {"lm_head.", "output."},
};
// Inside model.layers.N. -> blk.N.
constexpr std::pair<const char*, const char*> kLayerTensors[] = {
    {"self_attn.q_proj.", "attn_q."},   {"self_attn.k_proj.", "attn_k."},   {"self_attn.v_proj.", "attn_v."},
    {"self_attn.o_proj.", "attn_output."}, {"mlp.gate_proj.", "ffn_gate."}, {"mlp.up_proj.", "ffn_up."},
    {"mlp.down_proj.", "ffn_down."},   {"input_layernorm.", "attn_norm."}, {"post_attention_layernorm.", "ffn_norm."},
    {"self_attn.q_norm.", "attn_q_norm."}, {"self_attn.k_norm.", "attn_k_norm."},
    {"self_attn.qkv_proj.", "attn_qkv."},  {"mlp.gate_up_proj.", "ffn_up."},
    // A mixture of experts: the router, and each bank as one 3D tensor [experts, out, in], gate and
    // up apart (the exporter splits the fused bank: gguf_export.cpp).
    {"mlp.gate.", "ffn_gate_inp."}, {"mlp.experts.gate_proj.", "ffn_gate_exps."}, {"mlp.experts.up_proj.", "ffn_up_exps."},
    {"mlp.experts.down_proj.", "ffn_down_exps."},
};
constexpr const char* kLayerPrefix = "model.layers.";

// `name` with its Hugging Face prefix written as llama.cpp's, by the first of `prefixes`
// ({Hugging Face prefix, GGUF prefix}) it starts with; "" when it starts with none.
template <typename Prefixes>
std::string with_gguf_prefix(const Prefixes& prefixes, const std::string& name) {
  for (const auto& [hf, gguf] : prefixes) {
    const std::string hf_prefix = hf;
    if (starts_with(name, hf_prefix)) return gguf + name.substr(hf_prefix.size());
  }
  return "";
}

// The first family's row written as llama.cpp's `name`; nullptr when none is.
const GgufArchitecture* find_gguf_architecture(const std::string& name) {
  for (const auto& family : model_families()) {
    if (family.gguf.name == name) return &family.gguf;
  }
  return nullptr;
}

}  // namespace

const GgufArchitecture& gguf_architecture_for(const HfModelConfig& config) {
  const GgufArchitecture* found = config.family != nullptr && !config.family->gguf.name.empty() ? &config.family->gguf : nullptr;
  const auto& llama = config.llama;
  std::string problem;
  if (found == nullptr) {
    problem = config.architecture + " has no llama.cpp architecture qtrain writes";
  } else if (!found->reads_sliding_window && llama.sliding_window > 0 && llama.sliding_window < llama.max_position_embeddings &&
             std::find(llama.sliding_layers.begin(), llama.sliding_layers.end(), true) != llama.sliding_layers.end()) {
    // llama.cpp's llama / qwen2 / qwen3 attend over every earlier key, and its phi3 reads
    // sliding_window but turns it off: beyond the window it would be a different model.
    problem = config.architecture + " with sliding_window " + std::to_string(llama.sliding_window) + " (shorter than its " +
              std::to_string(llama.max_position_embeddings) + " positions) runs with full attention in llama.cpp's '" +
              found->name + "'";
  } else if ((llama.attention_bias || llama.output_bias) && !found->reads_attention_bias) {
    problem = config.architecture + " with attention_bias: llama.cpp's '" + found->name + "' reads no biases";
  } else if (llama.query_key_norm && !found->reads_query_key_norm) {
    problem = config.architecture + " with q_norm / k_norm: llama.cpp's '" + found->name + "' reads none";
  } else if (llama.feed_forward == FeedForwardKind::kExperts &&
             std::find(llama.dense_layers.begin(), llama.dense_layers.end(), true) != llama.dense_layers.end()) {
    problem = config.architecture + " with dense layers among its expert layers (mlp_only_layers / decoder_sparse_step): llama.cpp's '" +
              found->name + "' has experts in every layer";
  } else if (llama.feed_forward == FeedForwardKind::kExperts && !llama.experts.normalize_top_k &&
             !llama.experts.top_k_then_softmax) {
    problem = config.architecture + " with norm_topk_prob false: llama.cpp's '" + found->name +
              "' renormalises the chosen experts' weights";
  } else if (found->llama_cpp_difference != nullptr) {
    const auto difference = found->llama_cpp_difference(llama);
    if (!difference.empty()) problem = config.architecture + " with " + difference;
  }
  if (!problem.empty()) {
    throw Error(ErrorCode::kUsage, "GGUF export: " + problem + " (it writes Llama, Mistral, Mixtral and Phi-3 without a "
                "window shorter than the context, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, and Gemma 2 / 3 as llama.cpp fixes them); export safetensors-int or merged, and convert that with llama.cpp's "
                "convert_hf_to_gguf.py");
  }
  return *found;
}

std::string gguf_tensor_name(const std::string& hf_name, const std::string& architecture) {
  const auto* own = find_gguf_architecture(architecture);
  const auto model_tensor = with_gguf_prefix(kModelTensors, hf_name);
  if (!model_tensor.empty()) return model_tensor;
  const std::string layer_prefix = kLayerPrefix;
  if (starts_with(hf_name, layer_prefix)) {
    const auto rest = hf_name.substr(layer_prefix.size());
    const auto dot = rest.find('.');
    const auto layer = rest.substr(0, dot);
    if (dot != std::string::npos && !layer.empty() && layer.find_first_not_of("0123456789") == std::string::npos) {
      const auto inner = rest.substr(dot + 1);
      auto layer_tensor = own != nullptr ? with_gguf_prefix(own->layer_tensor_names, inner) : std::string();
      if (layer_tensor.empty()) layer_tensor = with_gguf_prefix(kLayerTensors, inner);
      if (!layer_tensor.empty()) return "blk." + layer + "." + layer_tensor;
    }
  }
  throw Error(ErrorCode::kInternal, "GGUF export: tensor '" + hf_name + "' has no place in llama.cpp's decoders (they hold "
              "embed_tokens, layers.N.self_attn / mlp projections, the norms, q_norm / k_norm and lm_head)");
}

std::string gguf_general_name(std::string name, const BaseDirectory& base) {
  for (const auto& family : model_families()) {
    const auto& rule = family.gguf.general_name_rule;
    std::string lower = name;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    const bool mentioned = std::any_of(rule.spellings.begin(), rule.spellings.end(),
                                       [&](const std::string& spelling) { return lower.find(spelling) != std::string::npos; });
    if (!mentioned) continue;
    const auto& tokenizer = base.tokenizer();
    const bool has_all = std::all_of(rule.tokens.begin(), rule.tokens.end(),
                                     [&](const std::string& token) { return tokenizer.token_to_id(token).has_value(); });
    if (has_all) continue;
    for (const auto& spelling : rule.spellings) {
      for (auto at = lower.find(spelling); at != std::string::npos; at = lower.find(spelling, at + 1)) {
        name.replace(at, spelling.size(), rule.replacement);
        lower.replace(at, spelling.size(), rule.replacement);
      }
    }
  }
  return name;
}

}  // namespace qtrain::trainer
