#pragma once
// The frozen base's storage, one row per kind: what QLoRA keeps its projections in. Everything
// that depends on the kind — loading (quantizing the linear layers), the memory estimate, what
// `qtrain inspect` and `qtrain bench` print — reads the row instead of comparing strings.
// The recipe spells it `quant: qlora` + `qlora.quant_type: nf4 | fp4 | int8 | fp8`, or `quant: qat` +
// `qat.base` (QAT-LoRA on a frozen quantized base; none: 16-bit); `quant: none` keeps a 16-bit
// base (`qlora.fp8_compute` puts its projections on FP8 tensor cores). QAT's fake quantization wraps
// the layers afterwards. Adding a kind is one enum value (trainer/recipe/recipe.h) and one row.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "kernels/error.h"
#include "qat/float8_linear.h"
#include "qat/four_bit_codec.h"
#include "qat/four_bit_linear.h"
#include "qat/int8_linear.h"
#include "trainer/model/llama.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

// A base's settings, from the recipe's qlora section.
struct BaseQuantizationSettings {
  BaseQuantization kind = BaseQuantization::kNone;
  torch::ScalarType compute_dtype = torch::kBFloat16;  // of the dense weights and the biases
  qat::FourBitOptions four_bit;  // nf4 / fp4: blocksize, double_quant (its quant_type is ignored: kind says it)
  // qlora.fp8_compute: the projections multiply on FP8 tensor cores. nf4 / fp4 dequantize to e4m3
  // rows for each product; none become e4m3 rows once, their 16-bit weights kept on the host for
  // merges and exports.
  bool multiply_on_float8 = false;
  qat::Int8Options int8;         // int8: llm_int8_threshold
  qat::Float8Options float8;     // fp8: where the weights are quantized
  std::vector<std::string> skip_modules = {"lm_head"};  // linear layers kept in the compute dtype
};

// One frozen layer made from random values on the device (`qtrain bench`: no checkpoint, and no
// 16-bit model that quantizing would need).
struct RandomLayerOptions {
  qat::DenseLinearOptions linear;  // the projection's shape (a 16-bit base's own layer)
  torch::Tensor bias;              // [out_features] in the compute dtype, or undefined
  torch::Device device = torch::kCPU;
  // nf4 / fp4: a real quantization's code tables and block layout, which the random codes index.
  qat::FourBitTensor four_bit_tables;
};

struct BaseQuantizationRow {
  BaseQuantization kind;     // its name and the keys that may name it: base_quantization_names() (recipe.h)
  const char* description;  // for bench and inspect lines
  // Replaces every linear layer of `model` not in skip_modules by this kind's frozen layer,
  // quantized from its weight in `compute_dtype` on `device`, one layer at a time.
  void (*quantize)(LlamaForCausalLMImpl& model, const BaseQuantizationSettings& settings);
  // Bytes of the frozen buffers of one [out, in] weight (the bias, in the compute dtype, apart).
  double (*weight_bytes)(int64_t out, int64_t in, const BaseQuantizationSettings& settings);
  // The LoRA path runs as one fused node over the base's matmul (qat/lora_matmul.h).
  bool fused_lora;
  // A checkpointed layer's recomputation keeps its dequantized weights for its backward
  // (qat::KeepBuiltWeights).
  bool keeps_built_weights;
  // Its layer builds rows of its weight alone (qat::LinearLayer::builds_weight_rows): an expert
  // bank of it is built again a block of experts at a time under train.expert_bank_block_mb.
  bool builds_weight_rows;
  // A frozen layer of this kind with random codes of about a 0.02-scaled weight's magnitude.
  std::shared_ptr<qat::LinearLayer> (*random_layer)(const RandomLayerOptions& layer,
                                                    const BaseQuantizationSettings& settings);
};

const std::vector<BaseQuantizationRow>& base_quantizations();
const BaseQuantizationRow& base_quantization_row(BaseQuantization kind);
// By name ("nf4", ...), as a command-line option (`what`) gives it; anything else is a usage
// Error naming `what` and listing the names. (A recipe's keys hold the kind, parsed.)
const BaseQuantizationRow& base_quantization_named(const std::string& name, const std::string& what);

// The recipe's base: quant qlora -> qlora.quant_type's row, quant qat -> qat.base's, with qlora.*'s
// settings; otherwise none. Throws where the qlora keys do not fit that base.
BaseQuantizationSettings base_quantization(const Recipe& recipe, torch::ScalarType compute_dtype,
                                           const torch::Device& device = torch::kCPU);

// A `kind` base with the qlora section's settings, unchecked (base_quantization checks them
// against the recipe; `qtrain bench` against its options).
BaseQuantizationSettings base_quantization_settings(BaseQuantization kind, const QloraRecipe& qlora,
                                                    torch::ScalarType compute_dtype, const torch::Device& device);

}  // namespace qtrain::trainer
