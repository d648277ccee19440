#pragma once
// compressed-tensors checkpoints, both ways: the format llm-compressor writes and vLLM, SGLang and
// transformers (with the compressed-tensors package) load quantized.
//   config.json   the base's, with quantization_config (compressed_tensors_config.h)
//   model.safetensors   for each quantized projection `<m>` the stored form of
//                 qat/compressed_weight.h: `<m>.weight_packed` + `<m>.weight_shape` (int64 [2]:
//                 out, in) or `<m>.weight`, `<m>.weight_scale`, `<m>.weight_zero_point`,
//                 `<m>.weight_global_scale`; everything else as the merged export writes it
//   generation_config.json, tokenizer files   as the merged export copies them
//
// Export: every linear layer but lm_head on a preset's grid (qat/quant_presets.h). A QAT layer
// trained on that preset writes its own codes and scales, so the file decompresses bit for bit to
// the weights of its last forward; any other weight is rounded to nearest as llm-compressor's
// QuantizationModifier does without calibration data. A layer whose input features the preset's
// groups do not divide stays dense and is named in `ignore`, as llm-compressor's users do.
//
// Import: each projection a config group targets becomes a qat::CompressedLinear holding the
// stored tensors (a frozen base kept in its stored form, under InputQuantizedLinear where the
// group quantizes input activations: dynamic, per token); the rest loads dense. Errors name the
// tensor or config.json's key.
#include <cstdint>
#include <string>
#include <vector>

#include "qat/quant_presets.h"
#include "trainer/formats/base_directory.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

struct CompressedTensorsExportOptions {
  const qat::QuantPreset* preset = nullptr;
  torch::ScalarType dtype = torch::kBFloat16;  // of the dense tensors, and of PTQ's rounding and scales
  uint64_t max_shard_bytes = 5'000'000'000;
};

// Writes `model` into `out_dir` (a fresh staging directory the caller renames into place) and
// returns the names of the linear layers left dense beside lm_head (groups that do not divide).
std::vector<std::string> write_compressed_tensors_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base,
                                                        const std::string& out_dir,
                                                        const CompressedTensorsExportOptions& options);

bool is_compressed_tensors_checkpoint(const HfModelConfig& config);

// load_llama's path for such a checkpoint: options.dtype is the dense parts' dtype (and compute's).
LoadedModel load_compressed_tensors_llama(const std::string& model_dir, const HfModelConfig& config,
                                          const ModelLoadOptions& options);

}  // namespace qtrain::trainer
