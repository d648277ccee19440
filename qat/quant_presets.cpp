#include "qat/quant_presets.h"

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

constexpr QuantPresetGrid kNoActivations{};

}  // namespace

const std::vector<QuantPreset>& quant_presets() {
  static const std::vector<QuantPreset> rows = {
      {"W4A16", "pack-quantized", {QuantFormat::kInt, 4, true, "per_group", 128}, false, kNoActivations, false},
      {"W4A16_ASYM", "pack-quantized", {QuantFormat::kInt, 4, false, "per_group", 128}, false, kNoActivations, false},
      {"W8A16", "pack-quantized", {QuantFormat::kInt, 8, true, "per_group", 128}, false, kNoActivations, false},
      {"W8A8", "int-quantized", {QuantFormat::kInt, 8, true, "per_channel", 0}, true,
       {QuantFormat::kInt, 8, true, "per_token", 0}, false},
      {"FP8_DYNAMIC", "float-quantized", {QuantFormat::kFp8E4m3, 8, true, "per_channel", 0}, true,
       {QuantFormat::kFp8E4m3, 8, true, "per_token", 0}, false},
      {"NVFP4A16", "nvfp4-pack-quantized", {QuantFormat::kFp4E2m1, 4, true, "per_group", 16}, false, kNoActivations,
       true},
  };
  return rows;
}

std::vector<std::string> quant_preset_names() {
  std::vector<std::string> names;
  for (const auto& row : quant_presets()) names.emplace_back(row.name);
  return names;
}

std::vector<std::string> trainable_quant_preset_names() {
  std::vector<std::string> names;
  for (const auto& row : quant_presets()) {
    if (!row.two_level_scales) names.emplace_back(row.name);
  }
  return names;
}

const QuantPreset& find_quant_preset(const std::string& name, const std::string& key) {
  std::string known;
  for (const auto& row : quant_presets()) {
    if (name == row.name) return row;
    known += (known.empty() ? "" : ", ") + std::string(row.name);
  }
  throw Error(ErrorCode::kUsage, key + ": unknown scheme '" + name + "' (compressed-tensors' presets: " + known + ")");
}

}  // namespace qtrain::qat
