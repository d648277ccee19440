#pragma once
// Fine-grained FP8 checkpoints as frozen bases: the format Qwen3-*-FP8 and DeepSeek publish and
// transformers reads with FineGrainedFP8Config (config.json: quantization_config {quant_method:
// "fp8", fmt: "e4m3", weight_block_size: [128, 128]}). Each quantized projection stores its
// weight as F8_E4M3 [out, in] and `<name>_scale_inv` fp32 [ceil(out / 128), ceil(in / 128)]: the
// weight is fp8 x scale_inv of its 128 x 128 block. Everything else is stored in 16 bits.
//
// Each FP8 projection loads as a qat::CompressedLinear keeping the e4m3 bytes and block scales as
// stored (a frozen base at one byte per weight, quant: none), each product dequantizing it as
// transformers does: the product in fp32, rounded once to the compute dtype. quant: qlora quantizes
// the dequantized weights again as any QLoRA base: with qlora.quant_type fp8, into e4m3 rows with
// one scale per row (qat/float8_linear.h), since FP8 tensor cores scale rows, not 128 x 128 blocks.
#include <string>

#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer {

// quantization_config.quant_method is "fp8".
bool is_fp8_block_checkpoint(const HfModelConfig& config);

// The model of `model_dir` with its FP8 projections kept as stored (load_llama's path for such a
// checkpoint). Errors name config.json's key or the tensor: another fmt or block layout, a scale
// of the wrong shape, an FP8 weight without its scale.
LoadedModel load_fp8_block_llama(const std::string& model_dir, const HfModelConfig& config,
                                 const ModelLoadOptions& options);

}  // namespace qtrain::trainer
