#pragma once
// Pre-quantized bitsandbytes checkpoints, 4-bit and LLM.int8 (below). 4-bit (what `from_pretrained(quantization_config=
// BitsAndBytesConfig(load_in_4bit=True, ...)).save_pretrained` writes; hub "bnb-4bit" models),
// loaded directly as a frozen QLoRA base: each quantized projection becomes a qat::FourBitLinear
// holding the stored bytes, everything else (embeddings, norms, lm_head and the modules in
// llm_int8_skip_modules) loads dense in the requested dtype.
//
// config.json: "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true,
//   "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
//   "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
//   "llm_int8_skip_modules": null | [names]}
// Weights of a quantized module `<m>`:
//   <m>.weight                                 uint8 [n/2, 1]   packed codes
//   <m>.weight.absmax                          fp32, or uint8 with double quant
//   <m>.weight.quant_map                       fp32 [16]
//   <m>.weight.nested_absmax / .nested_quant_map   fp32, double quant only
//   <m>.weight.quant_state.bitsandbytes__<nf4|fp4>  uint8: the JSON {"quant_type", "blocksize",
//       "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"}
#include <optional>
#include <string>
#include <vector>

#include "qat/four_bit_codec.h"
#include "qat/int8_linear.h"
#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer {

struct BnbQuantizationConfig {
  bool load_in_4bit = false;
  bool load_in_8bit = false;
  std::string quant_type = "fp4";  // bnb_4bit_quant_type (transformers' default)
  bool double_quant = false;       // bnb_4bit_use_double_quant
  torch::ScalarType compute_dtype = torch::kFloat32;  // bnb_4bit_compute_dtype
  std::vector<std::string> skip_modules;              // llm_int8_skip_modules
  double llm_int8_threshold = 6.0;                    // outlier threshold of an 8-bit checkpoint
};

// The quantization_config of config.json when its quant_method is bitsandbytes, else nullopt.
std::optional<BnbQuantizationConfig> read_bnb_quantization_config(const HfModelConfig& config);
bool is_bnb_4bit_checkpoint(const HfModelConfig& config);
bool is_bnb_8bit_checkpoint(const HfModelConfig& config);

// The quantized weight `<module>.weight` and its quant state, checked for consistency (an Error
// naming `source` and the tensor otherwise).
qat::FourBitTensor read_bnb_4bit_weight(const SafetensorsCheckpoint& weights, const std::string& module_name,
                                        const std::string& source);

// Loads a bitsandbytes 4-bit Llama directory; options.dtype is the dtype of the dense parts
// (and of compute), options.make_linear is not used (the checkpoint decides each layer's kind).
LoadedModel load_bnb_4bit_llama(const std::string& model_dir, const HfModelConfig& config,
                                const ModelLoadOptions& options);

// LLM.int8 checkpoints (`BitsAndBytesConfig(load_in_8bit=True)`, what transformers' save_pretrained
// writes for an 8-bit model), loaded directly as a frozen 8-bit base: each quantized projection
// `<m>` becomes a qat::Int8Linear with the checkpoint's llm_int8_threshold; the rest loads dense.
//   <m>.weight         int8 [out, in]  row-wise codes (bnb's CB)
//   <m>.SCB            fp32 [out]      each row's absmax
//   <m>.weight_format  uint8 scalar    0: row-major (the only layout bitsandbytes >= 0.45 writes)
// A projection is quantized when its weight is int8 or it has an SCB; an int8 weight without SCB,
// a weight of another shape than config.json's, or an SCB that is not fp32 [out] is an Error
// naming the tensor and what was expected.
std::shared_ptr<qat::Int8Linear> read_bnb_8bit_linear(const SafetensorsCheckpoint& weights,
                                                      const std::string& module_name, const std::vector<int64_t>& shape,
                                                      const torch::Tensor& bias, double threshold,
                                                      torch::ScalarType compute_dtype, const std::string& source);
LoadedModel load_bnb_8bit_llama(const std::string& model_dir, const HfModelConfig& config,
                                const ModelLoadOptions& options);

}  // namespace qtrain::trainer
