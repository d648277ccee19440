#include "trainer/formats/peft_adapter_config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "data/unicode_regex.h"
#include "kernels/error.h"

namespace qtrain::trainer {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // keeps rank_pattern / alpha_pattern in file order, as peft reads them

namespace {


// "(.*\.)?(P)$" from the start of the name: peft's get_pattern_key. PCRE2 (as Python's re, and
// with a bound on the work) rather than std::regex, whose recursion a pattern from a downloaded
// file can overflow or send into exponential backtracking.
bool matches_peft_pattern(const std::string& pattern, const std::string& module_name, const std::string& key) {
  const std::string where = std::string(kPeftConfigFile) + ": " + key + " pattern '" + pattern + "'";
  return data::UnicodeRegex("(?:.*\\.)?(?:" + pattern + ")", where, ErrorCode::kAdapter).full_match(module_name);
}

// Reading adapter_config.json: every value checked, every message naming the file and key.
class ConfigReader {
 public:
  ConfigReader(std::string path, Json json) : path_(std::move(path)), json_(std::move(json)) {}

  bool has(const std::string& key) const { return json_.contains(key) && !json_.at(key).is_null(); }

  const Json& at(const std::string& key) const { return json_.at(key); }

  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_number()) fail(key, "must be a number, got " + at(key).dump());
    return at(key).get<double>();
  }

  int64_t positive_integer(const std::string& key, int64_t fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_number_integer() || at(key).get<int64_t>() <= 0) {
      fail(key, "must be a positive integer, got " + at(key).dump());
    }
    return at(key).get<int64_t>();
  }

  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_boolean()) fail(key, "must be true or false, got " + at(key).dump());
    return at(key).get<bool>();
  }

  std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_string()) fail(key, "must be a string, got " + at(key).dump());
    return at(key).get<std::string>();
  }

  // peft's module lists: a list of names or one regex string.
  qat::ModuleSelector selector(const std::string& key) const {
    qat::ModuleSelector selector;
    if (!has(key)) return selector;
    if (at(key).is_string()) {
      selector.regex = at(key).get<std::string>();
    } else if (at(key).is_array()) {
      for (const auto& entry : at(key)) {
        if (!entry.is_string()) fail(key, "must list module names as strings, got " + entry.dump());
        selector.names.push_back(entry.get<std::string>());
      }
    } else {
      fail(key, "must be a list of module names or a regex string, got " + at(key).dump());
    }
    return selector;
  }

  template <typename Value>
  std::vector<std::pair<std::string, Value>> pattern_map(const std::string& key) const {
    std::vector<std::pair<std::string, Value>> patterns;
    if (!has(key)) return patterns;
    if (!at(key).is_object()) fail(key, "must be an object {module pattern: value}, got " + at(key).dump());
    for (const auto& item : at(key).items()) {
      const bool valid = std::is_integral<Value>::value ? item.value().is_number_integer() && item.value().get<int64_t>() > 0
                                                        : item.value().is_number();
      if (!valid) fail(key, "has a bad value for '" + item.key() + "': " + item.value().dump());
      patterns.emplace_back(item.key(), item.value().get<Value>());
    }
    return patterns;
  }

  // A setting qtrain does not implement must be absent, null, false or empty.
  void require_unset(const std::string& key, const std::string& what) const {
    if (!has(key)) return;
    const auto& value = at(key);
    const bool unset = (value.is_boolean() && !value.get<bool>()) || (value.is_array() && value.empty()) ||
                       (value.is_object() && value.empty()) || (value.is_string() && value.get<std::string>().empty());
    if (!unset) fail(key, "= " + value.dump() + " is not supported (" + what + ")");
  }

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw Error(ErrorCode::kAdapter, path_ + ": '" + key + "' " + problem);
  }

 private:
  std::string path_;
  Json json_;
};

// init_lora_weights values after which peft also rewrites the base weights (W - scale B A, a
// re-quantized base): the adapter is only right on that modified base.
bool init_modifies_base(const std::string& init) {
  return init.rfind("pissa", 0) == 0 || init == "olora" || init == "corda" || init == "loftq" || init == "lora_ga";
}

}  // namespace

qat::LoraOptions PeftAdapterConfig::options_for(const std::string& module_name) const {
  qat::LoraOptions options = lora;
  for (const auto& [pattern, rank] : rank_pattern) {
    if (matches_peft_pattern(pattern, module_name, "rank_pattern")) {
      options.rank = rank;
      break;
    }
  }
  for (const auto& [pattern, alpha] : alpha_pattern) {
    if (matches_peft_pattern(pattern, module_name, "alpha_pattern")) {
      options.alpha = alpha;
      break;
    }
  }
  return options;
}

PeftAdapterConfig read_peft_adapter_config(const std::string& adapter_dir) {
  if (!fs::is_directory(adapter_dir)) throw Error(ErrorCode::kAdapter, adapter_dir + ": no such adapter directory");
  const std::string path = (fs::path(adapter_dir) / kPeftConfigFile).string();
  std::ifstream stream(path);
  if (!stream) {
    throw Error(ErrorCode::kAdapter,
                path + ": not found (a PEFT adapter directory holds " + kPeftConfigFile + " and " + kPeftWeightsFile + ")");
  }
  std::ostringstream text;
  text << stream.rdbuf();
  return parse_peft_adapter_config(text.str(), path);
}

PeftAdapterConfig parse_peft_adapter_config(const std::string& text, const std::string& path) {
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::exception& error) {
    throw Error(ErrorCode::kAdapter, path + ": not valid JSON (" + error.what() + ")");
  }
  if (!json.is_object()) throw Error(ErrorCode::kAdapter, path + ": expected a JSON object of LoRA settings");
  const ConfigReader config(path, std::move(json));

  if (config.string("peft_type", "LORA") != "LORA") {
    config.fail("peft_type", "is '" + config.string("peft_type", "") + "'; qtrain reads LoRA adapters only");
  }
  const std::string task_type = config.string("task_type", "CAUSAL_LM");
  if (task_type != "CAUSAL_LM") config.fail("task_type", "is '" + task_type + "'; qtrain's Llama is a CAUSAL_LM model");
  const std::string bias = config.string("bias", "none");
  if (bias != "none") config.fail("bias", "is '" + bias + "'; only \"none\" is supported (no trained biases)");
  config.require_unset("lora_bias", "a bias on lora_B");
  config.require_unset("fan_in_fan_out", "transposed Conv1D weights; Llama uses nn.Linear");
  config.require_unset("use_qalora", "QALoRA");
  config.require_unset("use_bdlora", "block-diagonal LoRA");
  config.require_unset("velora_config", "VeLoRA");
  config.require_unset("kasa_config", "KaSA");
  config.require_unset("monteclora_config", "MonteCLoRA");
  config.require_unset("arrow_config", "Arrow routing");
  config.require_unset("alora_invocation_tokens", "activated LoRA");
  config.require_unset("modules_to_save", "fully trained modules saved next to the adapter");
  config.require_unset("trainable_token_indices", "trainable token embeddings");
  config.require_unset("layers_to_transform", "LoRA on a subset of layer indices");
  config.require_unset("layers_pattern", "LoRA on a subset of layer indices");
  config.require_unset("layer_replication", "layer replication");
  if (config.has("init_lora_weights") && config.at("init_lora_weights").is_string()) {
    const auto init = config.at("init_lora_weights").get<std::string>();
    if (init_modifies_base(init)) {
      config.fail("init_lora_weights", "is '" + init +
                                           "', which changes the base weights too; convert the adapter to plain LoRA "
                                           "with peft (save_pretrained(path_initial_model_for_weight_conversion=...))");
    }
  }

  PeftAdapterConfig result;
  // peft's LoraConfig defaults where a key is absent.
  result.lora.rank = config.positive_integer("r", 8);
  result.lora.alpha = config.number("lora_alpha", 8.0);
  result.lora.dropout = config.number("lora_dropout", 0.0);
  if (result.lora.dropout < 0.0 || result.lora.dropout >= 1.0) {
    config.fail("lora_dropout", "must be in [0, 1), got " + config.at("lora_dropout").dump());
  }
  result.lora.rslora = config.boolean("use_rslora", false);
  result.lora.dora = config.boolean("use_dora", false);
  result.targets.include = config.selector("target_modules");
  result.targets.parameters = config.selector("target_parameters");
  if (result.targets.parameters.regex) config.fail("target_parameters", "must be a list of parameter names");
  if (result.targets.include.empty() && result.targets.parameters.empty()) {
    config.fail("target_modules", "is missing or empty; name the adapted modules, e.g. [\"q_proj\", \"v_proj\"]");
  }
  result.targets.exclude = config.selector("exclude_modules");
  result.rank_pattern = config.pattern_map<int64_t>("rank_pattern");
  result.alpha_pattern = config.pattern_map<double>("alpha_pattern");
  return result;
}

}  // namespace qtrain::trainer
