#pragma once
// The shape and rotary-embedding settings of a Llama-style decoder, as config.json gives them
// (trainer/formats/hf_config.h reads them), with what the Mistral and Qwen families change in it
// (trainer/model/model_families.h says which family sets what). Plain data, free of LibTorch.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qtrain::trainer {

// kLongRope: Phi-3's, frequencies divided per dimension by short_factor, or by long_factor once a
// position passes original_max_position_embeddings, and cos / sin scaled by attention_factor.
// kYarn: YaRN (gpt-oss), frequencies blended between factor-interpolated and kept along a ramp
// between the dimensions that turn beta_fast and beta_slow times over the original context, cos
// and sin scaled by attention_factor.
enum class RopeType { kDefault, kLinear, kDynamic, kLlama3, kLongRope, kYarn };

// The decoder layer's feed-forward block (trainer/model/feed_forward.h): kDense, a gated MLP
// (gate, up, down); kExperts, a router choosing experts_per_token gated MLPs out of num_experts for
// each token (trainer/model/sparse_moe.h: Qwen3-MoE, Mixtral).
enum class FeedForwardKind { kDense, kExperts };

// A mixture-of-experts block's shape and routing, as config.json gives them.
struct ExpertOptions {
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;  // top-k
  int64_t intermediate_size = 0;  // each expert's (Qwen3-MoE's moe_intermediate_size)
  // The top-k probabilities (of the softmax over every expert) divided by their sum, so that the
  // chosen experts' weights add to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob).
  bool normalize_top_k = true;
  // The chosen experts' weights stay fp32 and multiply their outputs there (Mixtral); else they
  // are rounded to the model dtype first (Qwen3-MoE).
  bool weights_in_fp32 = false;
  // Mixtral's router_jitter_noise: in training, the block's input times uniform(1 - j, 1 + j).
  double router_jitter_noise = 0;
  // gpt-oss: the router is `router` (else `gate`) with a bias, the experts' banks have biases, the
  // top-k logits' own softmax (in the model dtype) weighs the chosen experts, and their SwiGLU is
  // clamped: (clamp(up, ±limit) + 1) · g σ(1.702 g), g = min(gate, limit).
  std::string router = "gate";
  bool biases = false;
  bool top_k_then_softmax = false;
  double swiglu_limit = 0;  // 0: the plain activation
  // transformers holds gate_up_proj as [experts, hidden, 2 · intermediate] (x @ W) with gate's and
  // up's columns interleaved (gpt-oss); qtrain's bank keeps gate's rows first all the same, and
  // checkpoints, peft adapters and exports are reordered at the edge.
  bool interleaved_gate_up = false;
  // The load-balancing loss (transformers' load_balancing_loss_func) joins the training loss times
  // router_aux_loss_coef where config.json's output_router_logits asks for it.
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;
};

// The MLP's gate activation: silu (SwiGLU: Llama, Mistral, Qwen) or tanh-approximated GELU
// (GeGLU, transformers' gelu_pytorch_tanh: Gemma).
enum class Activation { kSilu, kGeluTanh };

// RMSNorm's scale: Llama's casts the normed fp32 rows to the input dtype and multiplies by the
// weight there; kUnitOffset (Gemma's) multiplies the fp32 rows by (1 + weight) and casts the product.
enum class NormStyle { kLlama, kUnitOffset };

struct RopeOptions {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                   // linear, dynamic, llama3
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  int64_t original_max_position_embeddings = 0;  // llama3, dynamic, longrope (0 = max_position_embeddings)
  std::vector<double> short_factor, long_factor;   // longrope: [rotary dims / 2] each
  double attention_factor = 1.0;                   // longrope, yarn: multiplies cos and sin
  double beta_fast = 32.0, beta_slow = 1.0;        // yarn
  bool truncate = true;                            // yarn: the ramp's ends rounded to whole dimensions
};

struct LlamaOptions {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool attention_bias = false;  // q_proj, k_proj and v_proj have a bias
  bool output_bias = false;     // o_proj has one (Llama: as attention_bias; Qwen2: never)
  bool mlp_bias = false;
  FeedForwardKind feed_forward = FeedForwardKind::kDense;  // what follows attention in every layer
  ExpertOptions experts;  // FeedForwardKind::kExperts
  // With kExperts: layers whose block is the dense MLP of intermediate_size instead (Qwen3-MoE's
  // mlp_only_layers and decoder_sparse_step); empty: none.
  std::vector<bool> dense_layers;
  bool tie_word_embeddings = false;
  RopeOptions rope;
  // The leading fraction of each head the rotary embedding turns; the rest passes unrotated
  // (Phi-4-mini: 0.75). rotary_dim() is int(head_dim * factor), as transformers truncates it.
  double partial_rotary_factor = 1.0;
  // Phi-3: q, k and v come from one projection `qkv_proj` (rows in that order), gate and up from
  // `gate_up_proj` (gate's rows first); peft adapts and bitsandbytes quantizes them fused.
  bool fused_projections = false;
  // RMSNorm over each head's query and key (weights [head_dim], `self_attn.q_norm` / `k_norm`)
  // before the rotary embedding (Qwen3).
  bool query_key_norm = false;
  // Layers whose queries see only the keys of the last `sliding_window` positions, themselves
  // included (Mistral, Qwen's sliding layers); empty: every layer sees every earlier key.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;  // [num_hidden_layers] when not empty
  // The rotary settings of the sliding layers where they have their own (Gemma 3: theta 10k on
  // sliding layers, 1M and a linear scaling on full ones); unset: `rope` everywhere.
  std::optional<RopeOptions> sliding_rope;

  // Gemma: RMSNorm as x * (1 + w) in fp32, every sublayer's output normed too
  // (post_attention_layernorm on the attention's output, pre_ / post_feedforward_layernorm
  // around the MLP) before its residual add, embeddings scaled by sqrt(hidden_size) rounded to
  // the model dtype, and the score scale query_pre_attn_scalar^-1/2 instead of head_dim's.
  NormStyle norm_style = NormStyle::kLlama;
  bool sandwich_norms = false;
  bool scale_embeddings = false;
  Activation activation = Activation::kSilu;
  double query_pre_attn_scalar = 0;  // 0: scores scaled by head_dim^-1/2
  // Gemma 2's soft-capping, cap * tanh(x / cap), of the attention scores (before the mask) and
  // of the final logits; 0: none.
  double attention_softcap = 0;
  double final_logit_softcap = 0;
  // gpt-oss: a learned logit per head (`self_attn.sinks`) joins every query's softmax as one more
  // key with no value, so a query may attend to nothing.
  bool attention_sinks = false;

  // The block of decoder layer `layer`.
  FeedForwardKind layer_feed_forward(int64_t layer) const {
    const bool dense = layer < static_cast<int64_t>(dense_layers.size()) && dense_layers[static_cast<size_t>(layer)];
    return dense ? FeedForwardKind::kDense : feed_forward;
  }
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
  // The linear layers of each decoder layer, by the names transformers and peft give them: the
  // attention's, then the feed-forward block's (trainer/model/llama.cpp asks both).
  std::vector<std::string> projection_names() const;
  double attention_scale() const {
    // pow, as Python's ** computes transformers' scaling.
    return std::pow(query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim), -0.5);
  }
  // The rotary settings of `layer`.
  const RopeOptions& layer_rope(int64_t layer) const {
    return sliding_rope && layer_slides(layer) ? *sliding_rope : rope;
  }

  bool layer_slides(int64_t layer) const {
    return sliding_window > 0 && layer < static_cast<int64_t>(sliding_layers.size()) &&
           sliding_layers[static_cast<size_t>(layer)];
  }
};

// The projections of a default (Llama) decoder layer, as peft names them: the recipe's default
// lora.target_modules. Written out so that the recipe's parser needs no LibTorch;
// LlamaOptions{}.projection_names(), which asks the layer's blocks, equals it
// (LlamaModel.DefaultProjectionNamesAreTheBlocks).
inline const std::vector<std::string>& decoder_projection_names() {
  static const std::vector<std::string> names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return names;
}

}  // namespace qtrain::trainer
