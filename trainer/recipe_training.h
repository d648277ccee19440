#pragma once
// Recipe sections that Finetune and the memory estimate (trainer/model_memory.h) must read the
// same way, in one place.
#include <cstdint>

#include "trainer/hf_checkpoint.h"
#include "trainer/peft_adapter.h"
#include "trainer/recipe.h"

namespace qtrain::trainer {

// The adapters a run trains: lora.init_from's own configuration when it is set, else the
// recipe's lora section.
PeftAdapterConfig lora_adapter_config(const Recipe& recipe);

// The frozen base of a run as training builds it: model.path loaded on the CPU in `dtype`, and
// for quant: qlora its linear layers quantized with the qlora section's format on `device`
// (where the packed weights stay; the rest of the model is still on the CPU). quantize_base
// false skips that, for callers that only need the model's shapes and names.
LoadedModel load_base_model(const Recipe& recipe, torch::ScalarType dtype, const torch::Device& device = torch::kCPU,
                            bool quantize_base = true);

// train.loss_chunk_tokens, or the automatic chunk for the model's vocabulary when it is 0.
int64_t loss_chunk_tokens(const Recipe& recipe, int64_t vocab_size);

}  // namespace qtrain::trainer
