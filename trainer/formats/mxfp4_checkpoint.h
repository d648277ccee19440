#pragma once
// MXFP4 checkpoints as frozen bases: gpt-oss as OpenAI publishes it, read as transformers'
// Mxfp4Config does (config.json: quantization_config {quant_method: "mxfp4"}): each expert bank
// stored as `mlp.experts.gate_up_proj_blocks` uint8 [experts, 2 · intermediate, hidden / 32, 16],
// `_scales` uint8 [experts, 2 · intermediate, hidden / 32] (gate / up rows interleaved),
// `_bias`, and `down_proj_*` alike; everything else in 16 bits. The banks load as
// qat::Mxfp4Linear keeping those bytes (rows reordered gate-first, whole rows: exact), which stay
// the frozen base under quant: none and qlora alike; attention and the rest load as they are.
#include <string>

#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer {

// quantization_config.quant_method is "mxfp4".
bool is_mxfp4_checkpoint(const HfModelConfig& config);

LoadedModel load_mxfp4_llama(const std::string& model_dir, const HfModelConfig& config, const ModelLoadOptions& options);

}  // namespace qtrain::trainer
