#include "trainer/model/model_families.h"

namespace qtrain::trainer {

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      {"LlamaForCausalLM", "llama", "llama", AttentionBias::kFromConfig, false, SlidingWindowKeys::kNone},
      // Mistral 7B v0.1 slides over 4096 keys in every layer; v0.2+, Ministral and Nemo set null.
      {"MistralForCausalLM", "mistral", "llama", AttentionBias::kNone, false, SlidingWindowKeys::kEveryLayer},
      {"Qwen2ForCausalLM", "qwen2", "qwen2", AttentionBias::kQueryKeyValueOnly, false, SlidingWindowKeys::kLayerTypes},
      {"Qwen3ForCausalLM", "qwen3", "qwen3", AttentionBias::kFromConfig, true, SlidingWindowKeys::kLayerTypes},
      // Gemma 2 alternates sliding and full layers; Gemma 3 slides five in six, with a rope of their own.
      {"Gemma2ForCausalLM", "gemma2", "gemma2", AttentionBias::kFromConfig, false, SlidingWindowKeys::kLayerTypesOrPattern,
       /*gemma_block=*/true, /*sliding_pattern=*/2, /*rope_per_layer_type=*/false},
      {"Gemma3ForCausalLM", "gemma3_text", "gemma3", AttentionBias::kFromConfig, true,
       SlidingWindowKeys::kLayerTypesOrPattern, /*gemma_block=*/true, /*sliding_pattern=*/6, /*rope_per_layer_type=*/true,
       /*phi3_block=*/false, /*fp16_overflows=*/true},
      // Phi-3, Phi-3.5 and Phi-4(-mini): fused projections, partial rotary and longrope; Phi-3-mini
      // slides over 2047 keys in every layer.
      {"Phi3ForCausalLM", "phi3", "phi3", AttentionBias::kNone, false, SlidingWindowKeys::kEveryLayer,
       /*gemma_block=*/false, /*sliding_pattern=*/0, /*rope_per_layer_type=*/false, /*phi3_block=*/true},
  };
  return families;
}

const ModelFamily* find_model_family(const std::string& architecture, const std::string& model_type) {
  for (const auto& family : model_families()) {
    if (architecture.empty() ? family.model_type == model_type : family.architecture == architecture) return &family;
  }
  return nullptr;
}

std::string supported_architectures() {
  std::string names;
  for (const auto& family : model_families()) names += (names.empty() ? "" : ", ") + family.architecture;
  return names;
}

}  // namespace qtrain::trainer
