#include "trainer/formats/generation_config.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace qtrain::trainer {

GenerationOptions read_generation_config(const std::string& model_dir, const HfModelConfig& config) {
  GenerationOptions options;
  options.eos_token_ids = config.eos_token_ids;
  const std::string path = model_dir + "/generation_config.json";
  std::ifstream file(path);
  if (!file) return options;
  const auto object = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (object.is_discarded() || !object.is_object()) throw Error(ErrorCode::kModelConfig, path + ": not a JSON object");
  auto fail = [&](const std::string& key, const std::string& expected) {
    throw Error(ErrorCode::kModelConfig, path + ": key '" + key + "' must be " + expected + ", got " + object.at(key).dump());
  };
  auto has = [&](const char* key) { return object.contains(key) && !object.at(key).is_null(); };
  if (has("do_sample")) {
    if (!object.at("do_sample").is_boolean()) fail("do_sample", "true or false");
    options.sampling.do_sample = object.at("do_sample").get<bool>();
  }
  auto positive_number = [&](const char* key, double& target) {
    if (!has(key)) return;
    if (!object.at(key).is_number() || object.at(key).get<double>() <= 0) fail(key, "a positive number");
    target = object.at(key).get<double>();
  };
  positive_number("temperature", options.sampling.temperature);
  positive_number("top_p", options.sampling.top_p);
  positive_number("repetition_penalty", options.sampling.repetition_penalty);
  auto count = [&](const char* key, int64_t& target) {
    if (!has(key)) return;
    if (!object.at(key).is_number_integer() || object.at(key).get<int64_t>() < 0) fail(key, "a non-negative integer");
    target = object.at(key).get<int64_t>();
  };
  count("top_k", options.sampling.top_k);
  count("max_new_tokens", options.max_new_tokens);
  if (has("eos_token_id")) {
    const auto& eos = object.at("eos_token_id");
    options.eos_token_ids.clear();
    for (const auto& id : eos.is_array() ? eos : nlohmann::json::array({eos})) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0) fail("eos_token_id", "a token id or a list of them");
      options.eos_token_ids.push_back(id.get<int64_t>());
    }
  }
  return options;
}

std::string generation_config_json(const BaseDirectory& base) {
  if (base.generation_config) return *base.generation_config;
  const auto& config = base.config;
  nlohmann::ordered_json generation = nlohmann::ordered_json::object();
  if (config.bos_token_id) generation["bos_token_id"] = *config.bos_token_id;
  if (config.eos_token_ids.size() == 1) generation["eos_token_id"] = config.eos_token_ids.front();
  if (config.eos_token_ids.size() > 1) generation["eos_token_id"] = config.eos_token_ids;
  if (config.pad_token_id) generation["pad_token_id"] = *config.pad_token_id;
  return generation.dump(2) + "\n";
}

}  // namespace qtrain::trainer
