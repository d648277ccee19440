#pragma once
// compressed-tensors' preset schemes, one row each: what llm-compressor's
// `QuantizationModifier(scheme=NAME)` quantizes a model with and what vLLM and SGLang serve
// (compressed_tensors.quantization.quant_scheme, PRESET_SCHEMES, package 0.20). A row is the
// weights' grid, the input activations' grid (dynamic, per token) when the preset has one, and the
// compression format that stores the weights. `qat.weights.scheme` trains on a row's grid
// (QuantSpec::compressed_tensors_weights), `export.scheme` / `--scheme` writes it
// (trainer/formats/compressed_tensors.h). Free of LibTorch: the recipe and its fuzz target read it.
//
// The grids, as compressed-tensors computes them (calculate_qparams, _quantize, _dequantize):
//   int, symmetric    s = max(|min(x, 0)|, max(x, 0)) / ((q_max - q_min) / 2),  q = round(clamp(x / s, q_min, q_max))
//   int, asymmetric   s = (max(x, 0) - min(x, 0)) / (q_max - q_min),  z = round(clamp(q_min - min(x, 0) / s, q_min, q_max))
//                     q = round(clamp(x / s + z, q_min, q_max)), x^ = (q - z) * s
//   fp8 e4m3          s = absmax / 448, q = e4m3(clamp(x / s, -448, 448)), x^ = q * s
//   nvfp4             a global fp32 scale g = 448 * 6 / absmax(tensor); each group of 16's scale
//                     e4m3(g * absmax(group) / 6), the codes e2m1(x / (scale / g)), x^ = q * (scale / g)
// A scale that comes out 0 is replaced by its dtype's eps (2^-23 in fp32, 0.125 in e4m3); rounding
// is to nearest, ties to even.
#include <cstdint>
#include <string>
#include <vector>

#include "qat/quant_format.h"

namespace qtrain::qat {

// The weights' or activations' grid of a preset, in QuantSpec's terms (qat/quant_spec.h).
struct QuantPresetGrid {
  QuantFormat format = QuantFormat::kInt;
  int64_t bits = 4;
  bool symmetric = true;
  const char* granularity = "per_group";  // per_group | per_channel | per_token (QuantSpec's names)
  int64_t group_size = 0;                 // per_group only
};

struct QuantPreset {
  const char* name;                // "W4A16", as compressed-tensors and vLLM's docs spell it
  const char* compression_format;  // config.json's "format": pack-quantized, int-quantized, ...
  QuantPresetGrid weights;
  bool quantizes_activations;      // input activations on `activations`' grid, per token, dynamic
  QuantPresetGrid activations;
  // NVFP4: e4m3 group scales under one fp32 scale of the tensor (a second level QuantSpec does not
  // hold), so QAT cannot train on it; exports round to it after training.
  bool two_level_scales;
};

const std::vector<QuantPreset>& quant_presets();
std::vector<std::string> quant_preset_names();
// The row named `name`; an Error naming `key` and the presets otherwise.
const QuantPreset& find_quant_preset(const std::string& name, const std::string& key);
// The presets QAT trains on (every one without two-level scales), for the recipe's choices.
std::vector<std::string> trainable_quant_preset_names();

}  // namespace qtrain::qat
