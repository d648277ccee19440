#pragma once
// PEFT LoRA adapters in and out: a directory with `adapter_config.json` and
// `adapter_model.safetensors`, whose tensors are named
// `base_model.model.<module path>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]),
// what `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` reads.
#include <string>
#include <utility>
#include <vector>

#include "qat/lora_linear.h"
#include "trainer/model/llama.h"
#include "trainer/formats/peft_adapter_config.h"

namespace qtrain::trainer {

// Wraps the adapter's target modules of `model` in LoraLinear layers and loads A and B from
// `<adapter_dir>/adapter_model.safetensors` (fp32, on the model's device). Every expected tensor
// must be present with its shape and nothing else may be in the file; the model is left
// untouched when the adapter does not fit it.
void apply_peft_adapter(LlamaForCausalLMImpl& model, const std::string& adapter_dir);

// Writes the model's LoRA layers as a PEFT adapter directory that PeftModel.from_pretrained
// loads: adapter_config.json (from `config`, which must describe the model's LoRA layers) and
// adapter_model.safetensors (A and B in fp32). Written under a temporary name, then renamed;
// an existing `out_dir` is an Error, never overwritten.
void write_peft_adapter(const LlamaForCausalLMImpl& model, const PeftAdapterConfig& config, const std::string& out_dir,
                        const std::string& base_model_name_or_path);

}  // namespace qtrain::trainer
