#pragma once
// The decoder families qtrain loads, one row each: how config.json names them and what each
// changes in the Llama decoder (trainer/model/llama.h builds them all). Adding a family is adding a
// row here and, where it needs new math, a switch in LlamaOptions.
#include <string>
#include <vector>

#include "trainer/model/llama_options.h"

namespace qtrain::trainer {

// Which projections of the attention carry a bias.
enum class AttentionBias {
  kFromConfig,        // config.json's attention_bias, on q, k, v and o (Llama, Qwen3)
  kNone,              // never (Mistral)
  kQueryKeyValueOnly  // q, k and v always, o never (Qwen2)
};

// Where a family's sliding-window attention is set in config.json.
enum class SlidingWindowKeys {
  kNone,        // no sliding window (Llama)
  kEveryLayer,  // sliding_window (null: none) applies to every layer (Mistral)
  kLayerTypes,  // layer_types ("sliding_attention" / "full_attention"), or else use_sliding_window
                // with max_window_layers: layers from that index on slide (Qwen2, Qwen3)
  kLayerTypesOrPattern  // layer_types, or else every layer slides but each sliding_window_pattern-th
                        // (ModelFamily::sliding_pattern by default) (Gemma 2, Gemma 3)
};

struct ModelFamily {
  std::string architecture;       // config.json's architectures[0]
  std::string model_type;         // config.json's model_type
  std::string gguf_architecture;  // llama.cpp's general.architecture for this family
  AttentionBias attention_bias;
  bool query_key_norm;            // RMSNorm on each head's q and k before rope (Qwen3, Gemma 3)
  SlidingWindowKeys sliding_window;
  // Gemma's block (llama_options.h): (1 + w) RMSNorm, sandwich norms, scaled embeddings, and the
  // config keys hidden_activation, query_pre_attn_scalar, attn_logit_softcapping,
  // final_logit_softcapping.
  bool gemma_block = false;
  int64_t sliding_pattern = 0;       // kLayerTypesOrPattern's default
  bool rope_per_layer_type = false;  // rope_parameters.{sliding,full}_attention (Gemma 3)
  // Phi-3: qkv_proj and gate_up_proj (LlamaOptions::fused_projections); rope types "su" and "yarn"
  // are read as "longrope", as transformers' Phi3Config renames them; the dropout keys
  // embd_pdrop / resid_pdrop / attention_dropout must be 0.
  bool phi3_block = false;
  // The released checkpoints' activations pass fp16's 65,504 (Gemma 3: transformers#36822; Unsloth
  // and onnxruntime-genai move such runs off fp16): training in fp16 is refused.
  bool fp16_overflows = false;
};

const std::vector<ModelFamily>& model_families();

// The row for `architecture` (or, when that is empty, `model_type`); nullptr when none matches.
const ModelFamily* find_model_family(const std::string& architecture, const std::string& model_type);

// "LlamaForCausalLM, MistralForCausalLM, ...", for messages.
std::string supported_architectures();

}  // namespace qtrain::trainer
