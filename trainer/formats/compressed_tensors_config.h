#pragma once
// config.json's quantization_config of a compressed-tensors checkpoint (quant_method
// "compressed-tensors": what llm-compressor writes and vLLM and transformers read), read into
// plain data and written from one of compressed-tensors' presets (qat/quant_presets.h). Free of
// LibTorch, so that a fuzz target reads it (tests/fuzz/compressed_tensors_config_fuzz.cpp).
//
//   {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
//    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
//        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128,
//                    "dynamic": false, ...},
//        "input_activations": null | {... "strategy": "token", "dynamic": true}, "output_activations": null}},
//    "ignore": ["lm_head"], "kv_cache_scheme": null, "sparsity_config": {}, "version": "0.20.0", ...}
// A target or ignore entry is a module's class ("Linear") or name, or "re:" + a regex matched
// from the start of the name (Python's re.match).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qat/quant_presets.h"

namespace qtrain::trainer {

// One QuantizationArgs, the keys qtrain reads.
struct CompressedTensorsArgs {
  int64_t num_bits = 8;
  std::string type = "int";          // int | float
  bool symmetric = true;
  std::string strategy = "tensor";   // tensor | channel | group | tensor_group | block | token
  int64_t group_size = 0;            // group, tensor_group
  bool dynamic = false;
  std::string scale_dtype;           // empty, or the e4m3 dtype NVFP4 names
};

struct CompressedTensorsGroup {
  std::string name;  // group_0
  std::vector<std::string> targets;
  std::optional<CompressedTensorsArgs> weights;
  std::optional<CompressedTensorsArgs> input_activations;
  std::string format;  // the group's, or the config's
};

struct CompressedTensorsConfig {
  std::string format;  // the config's (mixed-precision: each group's own)
  std::vector<CompressedTensorsGroup> groups;
  std::vector<std::string> ignore;
};

// Whether `config_json` (config.json's text) names quant_method compressed-tensors.
bool is_compressed_tensors_config(const std::string& config_json);

// The quantization_config of `config_json`. Errors (kModelConfig) name `path` and the key: a
// missing or mistyped key, a checkpoint that is not compressed (quantization_status frozen: its
// weights are plain), sparsity, transforms, output activation or KV cache quantization (qtrain
// would run a different model), an unknown format.
CompressedTensorsConfig parse_compressed_tensors_config(const std::string& config_json, const std::string& path);

// Whether `target` (a targets / ignore entry) names the linear module `name` (class Linear).
bool compressed_tensors_target_matches(const std::string& target, const std::string& name);
// The group whose targets name the linear module `name`, null when none does or `ignore` does.
const CompressedTensorsGroup* find_compressed_tensors_group(const CompressedTensorsConfig& config, const std::string& name);

// The bytes projection `name` [out, in] takes in the checkpoint's stored form (codes, scales in
// `scale_bytes` each, zero points, NVFP4's global scale), as qat::CompressedLinear keeps it; a
// negative number where the checkpoint stores it dense. For the memory estimate.
double compressed_tensors_stored_bytes(const CompressedTensorsConfig& config, const std::string& name, int64_t out,
                                       int64_t in, int64_t scale_bytes);

// config.json's quantization_config for `preset` on every Linear but `ignore`, as llm-compressor
// writes it (JSON text, an object), with compressed-tensors' `version`.
std::string compressed_tensors_config_json(const qat::QuantPreset& preset, const std::vector<std::string>& ignore);

}  // namespace qtrain::trainer
