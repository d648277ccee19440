#pragma once
// A PEFT LoRA adapter's adapter_config.json, read into plain settings (trainer/formats/peft_adapter.h
// loads and writes whole adapters). Free of LibTorch: the fuzz targets build it alone.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "qat/lora_options.h"

namespace qtrain::trainer {

constexpr const char* kPeftConfigFile = "adapter_config.json";
constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";

struct PeftAdapterConfig {
  qat::LoraOptions lora;     // r, lora_alpha, lora_dropout, use_rslora
  qat::LoraTargets targets;  // target_modules (list or regex string), exclude_modules
  // peft's per-module overrides, in file order: the first pattern P with
  // re.match("(.*\.)?(P)$", module name) gives that module's r / lora_alpha.
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;

  // The options of one module, with rank_pattern / alpha_pattern applied.
  qat::LoraOptions options_for(const std::string& module_name) const;
};

// Reads `<adapter_dir>/adapter_config.json`. Settings qtrain cannot reproduce (DoRA, LoRA
// biases, modules_to_save, layers_to_transform, ...) are an Error naming the key.
PeftAdapterConfig read_peft_adapter_config(const std::string& adapter_dir);
// The same from adapter_config.json's text; `path` names the file in errors.
PeftAdapterConfig parse_peft_adapter_config(const std::string& text, const std::string& path);

}  // namespace qtrain::trainer
