// A compressed-tensors checkpoint's config.json (trainer/formats/compressed_tensors_config.h),
// then its targets and ignore patterns matched against module names, as loading one does.
#include "fuzz_support.h"
#include "trainer/formats/compressed_tensors_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto text = qtrain::fuzz::bytes_text(data, size);
    if (!qtrain::trainer::is_compressed_tensors_config(text)) return;
    const auto config = qtrain::trainer::parse_compressed_tensors_config(text, "config.json");
    if (config.groups.empty()) std::abort();
    for (const char* module : {"model.layers.0.self_attn.q_proj", "model.layers.11.mlp.down_proj", "lm_head"}) {
      const auto* group = qtrain::trainer::find_compressed_tensors_group(config, module);
      if (group != nullptr && group->weights && (group->weights->num_bits < 1 || group->weights->num_bits > 8)) std::abort();
    }
  });
  return 0;
}
