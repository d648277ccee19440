#include "trainer/peft_adapter.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "kernels/error.h"
#include "qat/qat_linear.h"
#include "trainer/file_system.h"
#include "trainer/safetensors.h"

namespace qtrain::trainer {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // keeps rank_pattern / alpha_pattern in file order, as peft reads them

namespace {

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
// peft saves the state dict of PeftModel -> LoraModel (`base_model`) -> the transformers model (`model`).
constexpr const char* kPeftPrefix = "base_model.model.";

std::string lora_A_name(const std::string& module_name) { return kPeftPrefix + module_name + ".lora_A.weight"; }
std::string lora_B_name(const std::string& module_name) { return kPeftPrefix + module_name + ".lora_B.weight"; }

// "(.*\.)?(P)$" from the start of the name: peft's get_pattern_key.
bool matches_peft_pattern(const std::string& pattern, const std::string& module_name, const std::string& key) {
  try {
    return std::regex_match(module_name, std::regex("(.*\\.)?(" + pattern + ")"));
  } catch (const std::regex_error& error) {
    throw Error(std::string(kConfigFile) + ": " + key + " pattern '" + pattern + "' is not a valid regular expression (" +
                error.what() + ")");
  }
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
    throw Error(path_ + ": '" + key + "' " + problem);
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

std::vector<std::pair<std::string, std::shared_ptr<qat::LoraLinear>>> lora_layers(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<qat::LoraLinear>>> layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto lora = std::dynamic_pointer_cast<qat::LoraLinear>(item.value())) layers.emplace_back(item.key(), lora);
    // Under QAT the adapters sit inside the fake-quantizing layer, under the same names.
    if (auto quantized = std::dynamic_pointer_cast<qat::QatLinear>(item.value())) {
      if (auto lora = std::dynamic_pointer_cast<qat::LoraLinear>(quantized->inner())) layers.emplace_back(item.key(), lora);
    }
  }
  return layers;
}

torch::Device device_of(const torch::nn::Module& model) {
  for (const auto& parameter : model.parameters()) return parameter.device();
  return torch::kCPU;
}

Json selector_json(const qat::ModuleSelector& selector) {
  if (selector.regex) return *selector.regex;
  return selector.names;
}

// Whether peft reads the targets as qtrain does. qtrain's list conveniences (regex entries,
// "all-linear" inside a list) mean nothing to peft's list form; such adapters are written with
// the exact names of the wrapped modules instead.
bool peft_reads_targets_alike(const qat::LoraTargets& targets) {
  for (const auto* selector : {&targets.include, &targets.exclude}) {
    for (const auto& entry : selector->names) {
      if (qat::ModuleSelector::is_extended_entry(entry)) return false;
    }
  }
  return true;
}

std::string number_text(double value) {
  std::ostringstream text;
  text << value;
  return text.str();
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
  if (!fs::is_directory(adapter_dir)) throw Error(adapter_dir + ": no such adapter directory");
  const std::string path = (fs::path(adapter_dir) / kConfigFile).string();
  std::ifstream stream(path);
  if (!stream) {
    throw Error(path + ": not found (a PEFT adapter directory holds " + kConfigFile + " and " + kWeightsFile + ")");
  }
  Json json;
  try {
    json = Json::parse(stream);
  } catch (const Json::exception& error) {
    throw Error(path + ": not valid JSON (" + error.what() + ")");
  }
  if (!json.is_object()) throw Error(path + ": expected a JSON object of LoRA settings");
  const ConfigReader config(path, std::move(json));

  if (config.string("peft_type", "LORA") != "LORA") {
    config.fail("peft_type", "is '" + config.string("peft_type", "") + "'; qtrain reads LoRA adapters only");
  }
  const std::string task_type = config.string("task_type", "CAUSAL_LM");
  if (task_type != "CAUSAL_LM") config.fail("task_type", "is '" + task_type + "'; qtrain's Llama is a CAUSAL_LM model");
  const std::string bias = config.string("bias", "none");
  if (bias != "none") config.fail("bias", "is '" + bias + "'; only \"none\" is supported (no trained biases)");
  config.require_unset("use_dora", "DoRA");
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
  config.require_unset("target_parameters", "LoRA on parameters instead of modules");
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
    config.fail("lora_dropout", "must be in [0, 1), got " + number_text(result.lora.dropout));
  }
  result.lora.rslora = config.boolean("use_rslora", false);
  result.targets.include = config.selector("target_modules");
  if (result.targets.include.empty()) {
    config.fail("target_modules", "is missing or empty; name the adapted modules, e.g. [\"q_proj\", \"v_proj\"]");
  }
  result.targets.exclude = config.selector("exclude_modules");
  result.rank_pattern = config.pattern_map<int64_t>("rank_pattern");
  result.alpha_pattern = config.pattern_map<double>("alpha_pattern");
  return result;
}

void apply_peft_adapter(LlamaForCausalLMImpl& model, const std::string& adapter_dir) {
  const auto config = read_peft_adapter_config(adapter_dir);
  const std::string config_path = (fs::path(adapter_dir) / kConfigFile).string();
  const std::string weights_path = (fs::path(adapter_dir) / kWeightsFile).string();
  if (!fs::exists(weights_path)) {
    if (fs::exists(fs::path(adapter_dir) / "adapter_model.bin")) {
      throw Error(weights_path + ": not found, only a pickled adapter_model.bin; re-save the adapter with peft's "
                                 "save_pretrained(..., safe_serialization=True)");
    }
    throw Error(weights_path + ": not found (the adapter's weights)");
  }
  if (!lora_layers(model).empty()) {
    throw Error(adapter_dir + ": the model already has LoRA layers; apply one adapter to a plain base model");
  }

  // Check the whole file against the model before changing anything.
  const auto targets = qat::find_lora_targets(model, config.targets);
  if (targets.empty()) {
    throw Error(config_path + ": target_modules " + config.targets.include.describe() +
                " matches no linear layer of the model (names look like 'model.layers.0.self_attn.q_proj')");
  }
  auto weights = SafetensorsCheckpoint::open(weights_path);
  std::set<std::string> expected;
  auto check = [&](const std::string& name, std::vector<int64_t> shape) {
    if (!weights.contains(name)) {
      throw Error(weights_path + ": tensor '" + name + "' is missing (" + kConfigFile + " targets this module; expected shape " +
                  shape_text(shape) + ")");
    }
    const auto stored = weights.info(name).shape;
    if (std::vector<int64_t>(stored.begin(), stored.end()) != shape) {
      throw Error(weights_path + ": tensor '" + name + "' has shape " + shape_text(stored) + ", expected " +
                  shape_text(shape) + " (r from " + kConfigFile + ", features from the model)");
    }
    expected.insert(name);
  };
  for (const auto& target : targets) {
    const int64_t rank = config.options_for(target.name).rank;
    check(lora_A_name(target.name), {rank, target.layer->in_features()});
    check(lora_B_name(target.name), {target.layer->out_features(), rank});
  }
  std::vector<std::string> unexpected;
  for (const auto& name : weights.names()) {
    if (!expected.count(name)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string listed;
    for (size_t index = 0; index < unexpected.size() && index < 3; ++index) listed += " '" + unexpected[index] + "'";
    throw Error(weights_path + ": " + std::to_string(unexpected.size()) + " tensor(s) that no target module of " +
                kConfigFile + " takes:" + listed + (unexpected.size() > 3 ? " ..." : "") + " (target_modules " +
                config.targets.include.describe() + ")");
  }

  qat::apply_lora(model, config.targets, [&](const std::string& name) { return config.options_for(name); });
  torch::NoGradGuard no_grad;
  for (const auto& [name, lora] : lora_layers(model)) {
    for (const auto& [tensor_name, target] : {std::make_pair(lora_A_name(name), lora->lora_A()),
                                              std::make_pair(lora_B_name(name), lora->lora_B())}) {
      auto stored = weights.tensor(tensor_name);
      if (!stored.is_floating_point()) {
        throw Error(weights_path + ": tensor '" + tensor_name + "' has dtype " +
                    std::string(c10::toString(stored.scalar_type())) + ", expected floating point weights");
      }
      target.copy_(stored.to(torch::kFloat32));
    }
  }
}

void write_peft_adapter(const LlamaForCausalLMImpl& model, const PeftAdapterConfig& config, const std::string& out_dir,
                        const std::string& base_model_name_or_path) {
  fs::path out = fs::path(out_dir).lexically_normal();
  if (!out.has_filename()) out = out.parent_path();
  if (fs::exists(out)) {
    throw Error(out.string() + ": already exists; qtrain never overwrites an adapter (choose another directory or remove it)");
  }
  const auto layers = lora_layers(model);
  if (layers.empty()) throw Error(out.string() + ": the model has no LoRA layers to write as a PEFT adapter");

  // The config must describe the model, or peft would build a different adapter from it.
  std::vector<std::string> wrapped;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& [name, lora] : layers) {
    if (!config.targets.matches(name)) {
      throw Error(out.string() + ": module '" + name + "' has a LoRA layer but target_modules " +
                  config.targets.include.describe() + " does not select it");
    }
    const auto expected = config.options_for(name);
    const auto& actual = lora->options();
    if (actual.rank != expected.rank || actual.alpha != expected.alpha || actual.rslora != expected.rslora) {
      throw Error(out.string() + ": module '" + name + "' has LoRA r=" + std::to_string(actual.rank) +
                  " alpha=" + number_text(actual.alpha) + (actual.rslora ? " (rsLoRA)" : "") +
                  " but the adapter config says r=" + std::to_string(expected.rank) + " alpha=" +
                  number_text(expected.alpha) + (expected.rslora ? " (rsLoRA)" : ""));
    }
    wrapped.push_back(name);
    tensors.emplace_back(lora_A_name(name), lora->lora_A().detach().to(torch::kCPU, torch::kFloat32).contiguous());
    tensors.emplace_back(lora_B_name(name), lora->lora_B().detach().to(torch::kCPU, torch::kFloat32).contiguous());
  }
  const auto unwrapped = qat::find_lora_targets(model, config.targets);
  if (!unwrapped.empty()) {
    throw Error(out.string() + ": module '" + unwrapped.front().name + "' matches target_modules " +
                config.targets.include.describe() + " but has no LoRA layer");
  }

  // Written in file order: with several matching patterns peft takes the first.
  Json rank_pattern = Json::object(), alpha_pattern = Json::object();
  for (const auto& [pattern, rank] : config.rank_pattern) rank_pattern[pattern] = rank;
  for (const auto& [pattern, alpha] : config.alpha_pattern) alpha_pattern[pattern] = alpha;
  Json target_modules, exclude_modules;
  if (peft_reads_targets_alike(config.targets)) {
    target_modules = selector_json(config.targets.include);
    if (!config.targets.exclude.empty()) exclude_modules = selector_json(config.targets.exclude);
  } else {
    target_modules = wrapped;
  }
  const double alpha = config.lora.alpha;
  // The keys peft's LoraConfig has had since 0.10 (exclude_modules since 0.14, only when
  // set), sorted as peft writes them; what is left out takes peft's defaults.
  Json json = {
      {"alpha_pattern", alpha_pattern},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path", base_model_name_or_path},
      {"bias", "none"},
  };
  if (!exclude_modules.is_null()) json["exclude_modules"] = exclude_modules;
  json.update(Json{
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", alpha == std::floor(alpha) ? Json(static_cast<int64_t>(alpha)) : Json(alpha)},
      {"lora_dropout", config.lora.dropout},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", config.lora.rank},
      {"rank_pattern", rank_pattern},
      {"revision", nullptr},
      {"target_modules", target_modules},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", config.lora.rslora},
  });

  // Everything goes into a hidden sibling first, so `out` appears whole or not at all.
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const fs::path staging = parent / ("." + out.filename().string() + ".tmp-" + std::to_string(::getpid()));
  try {
    fs::create_directories(parent);
    remove_tree(staging.string());
    fs::create_directory(staging);
    {
      std::ofstream stream(staging / kConfigFile);
      stream << json.dump(2) << "\n";
      stream.close();
      if (!stream) throw Error((staging / kConfigFile).string() + ": could not be written (disk full?)");
    }
    write_safetensors((staging / kWeightsFile).string(), tensors, {{"format", "pt"}});
    fs::rename(staging, out);
  } catch (const fs::filesystem_error& error) {
    remove_tree(staging.string());
    throw Error(out.string() + ": could not write the adapter (" + error.what() + ")");
  } catch (...) {
    remove_tree(staging.string());
    throw;
  }
}

}  // namespace qtrain::trainer
