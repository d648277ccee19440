// A model's config.json (trainer/formats/hf_config.h): keys of transformers 4.x and 5.x, rope scaling.
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
  });
  return 0;
}
