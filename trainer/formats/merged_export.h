#pragma once
// Merged export: a model with its LoRA adapters folded into the base weights and written as a
// plain Hugging Face Llama directory, which transformers (AutoModelForCausalLM.from_pretrained)
// and vLLM load without peft or bitsandbytes:
//   model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json
//   config.json             the base's, without quantization_config, its dtype the one written
//   generation_config.json  the base's (or one made of config.json's token ids)
//   tokenizer files         copied from the base directory
// Every linear layer becomes one dense weight: W + scale * B A computed in fp32 (peft's
// merge_and_unload), W dequantized first when the base is 4-bit or int8 (codes * SCB / 127, as
// bitsandbytes' int8_vectorwise_dequant), then cast to the output dtype.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trainer/formats/base_directory.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

struct MergedExportOptions {
  torch::ScalarType dtype = torch::kBFloat16;  // of every written tensor
  uint64_t max_shard_bytes = 5'000'000'000;    // save_pretrained's max_shard_size
};

// The model's tensors under Hugging Face names, in module order, on the CPU in `dtype`; each
// linear layer (LoRA, 4-bit or dense) as `<name>.weight` (and `<name>.bias`).
std::vector<std::pair<std::string, torch::Tensor>> merged_weights(const LlamaForCausalLMImpl& model,
                                                                  torch::ScalarType dtype);

// The base's config.json text with quantization_config removed and its dtype key(s) (`dtype`,
// `torch_dtype`; `torch_dtype` when it has neither) set to `dtype`.
std::string merged_config_json(const HfModelConfig& base_config, torch::ScalarType dtype);

// "5GB", "500MB", "2GiB", "1000000" (bytes) -> bytes, as save_pretrained's max_shard_size
// reads them (GB = 10^9, GiB = 2^30); Error naming `what` otherwise.
uint64_t parse_byte_size(const std::string& text, const std::string& what);

// Writes what a Hugging Face model directory holds beside its weights and config.json:
// generation_config.json (the base's, or one made of config.json's token ids) and the base's
// tokenizer files. For every export that writes a model directory.
void write_generation_config_and_tokenizer(const BaseDirectory& base, const std::string& out_dir);

// Writes the merged model into `out_dir` (created; it should be a fresh staging directory that
// the caller renames into place). `base` supplies config.json, generation_config.json and the
// tokenizer.
void write_merged_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_dir,
                        const MergedExportOptions& options);

}  // namespace qtrain::trainer
