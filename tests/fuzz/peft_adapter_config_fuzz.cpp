// A PEFT adapter's adapter_config.json (trainer/formats/peft_adapter_config.h), then its rank_pattern
// and alpha_pattern regexes applied to module names, as loading an adapter does.
#include "fuzz_support.h"
#include "trainer/formats/peft_adapter_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto config =
        qtrain::trainer::parse_peft_adapter_config(qtrain::fuzz::bytes_text(data, size), "adapter_config.json");
    for (const char* module : {"model.layers.0.self_attn.q_proj", "model.layers.11.mlp.down_proj", "lm_head"}) {
      const auto options = config.options_for(module);
      if (options.rank <= 0) std::abort();
    }
  });
  return 0;
}
