#pragma once
// "safetensors-int": a QAT model written with its integer weights, for any QuantSpec (GGUF holds
// only Q4_0 / Q8_0). A Hugging Face-like directory:
//   model.safetensors      for each QAT layer X:
//                            X.weight             int8 codes q (int formats), or uint8 codes
//                                                 (float formats: the minifloat's bits or the
//                                                 4-bit table index), the weight's shape
//                            X.weight_scale       fp16 (scale_dtype fp16) or fp32, params shape
//                                                 (qat/quant_spec.h: [out, in / group] per group,
//                                                 [out, 1] per channel, [1] per tensor)
//                            X.weight_zero_point  int8, params shape (asymmetric schemes only); fp32
//                                                 offsets m with zero_point_domain float
//                          every other tensor as the merged export writes it (in `dtype`);
//                          __metadata__ "qtrain.quantization" holds the scheme as JSON (below)
//   config.json            the base's, with quantization_config = that JSON:
//                            {"quant_method": "qtrain",
//                             "weights": {"format": "int", "bits": 4, "symmetric": true,
//                                         "granularity": "per_group", "group_size": 32,
//                                         "scale_dtype": "float16", "zero_point_domain": "int"},
//                             "activations": null | {the same keys, "observer": "dynamic"}}
//   generation_config.json, tokenizer files   as the merged export copies them
// Dequantized, X.weight is (q - z) * s, or q * s + (m - quant_min * s) with a float zero point
// (qat/quant_spec.h): exactly the fake-quant weight the QAT forward used. With
// activations, the loader fake-quantizes each QAT layer's input as training did (dynamic
// scales only: a static or learned activation scale is state this format does not hold yet).
#include <string>

#include "trainer/formats/base_directory.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

struct QuantizedExportOptions {
  torch::ScalarType dtype = torch::kFloat32;  // of the tensors that are not quantized
  uint64_t max_shard_bytes = 5'000'000'000;
};

// Writes `model` (with QatLinear layers; an Error when it has none) into `out_dir` (created; a
// fresh staging directory the caller renames into place). `base`: config.json, tokenizer and
// generation config.
void write_quantized_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_dir,
                           const QuantizedExportOptions& options = {});

// Whether config.json's quantization_config is ours (quant_method "qtrain").
bool is_qtrain_quantized_checkpoint(const HfModelConfig& config);

// Builds the model of a safetensors-int directory: dense layers holding the dequantized weights
// (in options.dtype), wrapped to quantize their inputs when the scheme has activations.
// Errors name the tensor (missing scale, wrong shape or dtype) or the quantization_config key.
LoadedModel load_qtrain_quantized_llama(const std::string& model_dir, const HfModelConfig& config,
                                        const ModelLoadOptions& options);

}  // namespace qtrain::trainer
