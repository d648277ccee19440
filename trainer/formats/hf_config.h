#pragma once
// Hugging Face `config.json` (transformers 4.x and 5.x keys) of a supported family
// (trainer/model/model_families.h) turned into LlamaOptions.
#include <c10/core/ScalarType.h>

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "trainer/model/llama_options.h"
#include "trainer/model/model_families.h"

namespace qtrain::trainer {

struct HfModelConfig {
  std::string path;          // the config.json read
  std::string architecture;  // e.g. LlamaForCausalLM
  const ModelFamily* family = nullptr;  // its row of model_families()
  LlamaOptions llama;
  c10::ScalarType stored_dtype = c10::ScalarType::Float;  // `dtype` (5.x) or `torch_dtype` (4.x)
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;                // a single id or a list in config.json
  std::optional<int64_t> pad_token_id;
  std::string rope_type_name;                        // as written: default, linear, dynamic, llama3
  bool has_quantization_config = false;
  std::string json;                                  // the file's text, for exports that rewrite it
};

HfModelConfig read_hf_config(const std::string& model_dir);
// The same from config.json's text; `path` names the file in errors.
HfModelConfig parse_hf_config(const std::string& text, const std::string& path);

// "bf16"/"bfloat16", "fp16"/"float16", "fp32"/"float32" -> scalar type; Error naming `what`,
// with `code` (a recipe key by default; config.json passes kModelConfig).
c10::ScalarType parse_dtype_name(const std::string& name, const std::string& what, ErrorCode code = ErrorCode::kRecipe);
std::string dtype_short_name(c10::ScalarType dtype);

// config.json's quantization_config object (null when there is none); an Error naming the file
// when config.json is not valid JSON.
nlohmann::json quantization_config_json(const HfModelConfig& config);

}  // namespace qtrain::trainer
