// A model's config.json (trainer/formats/hf_config.h): keys of transformers 4.x and 5.x, rope scaling,
// mixtures of experts (seeds in tests/fuzz/corpus/hf_config: Qwen3-MoE, Mixtral, gpt-oss as transformers writes them).
#include "fuzz_support.h"
#include "trainer/formats/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto config = qtrain::trainer::parse_hf_config(qtrain::fuzz::bytes_text(data, size), "config.json");
    // An accepted config describes a model that can be built: positive sizes, whole heads.
    const auto& llama = config.llama;
    if (llama.hidden_size <= 0 || llama.num_attention_heads <= 0 || llama.num_key_value_heads <= 0 ||
        llama.head_dim <= 0 || llama.num_attention_heads % llama.num_key_value_heads != 0) {
      std::abort();
    }
    // A mixture of experts: positive sizes, no more chosen experts than there are, a flag per layer.
    const auto& experts = llama.experts;
    if (llama.feed_forward == qtrain::trainer::FeedForwardKind::kExperts &&
        (experts.num_experts <= 0 || experts.intermediate_size <= 0 || experts.experts_per_token <= 0 ||
         experts.experts_per_token > experts.num_experts ||
         (!llama.dense_layers.empty() && static_cast<int64_t>(llama.dense_layers.size()) != llama.num_hidden_layers))) {
      std::abort();
    }
  });
  return 0;
}
