#include "trainer/formats/peft_adapter.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "kernels/error.h"
#include "qat/expert_linear.h"
#include "qat/qat_linear.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // keeps rank_pattern / alpha_pattern in file order, as peft reads them

namespace {

constexpr const char* kConfigFile = kPeftConfigFile;
constexpr const char* kWeightsFile = kPeftWeightsFile;
// peft saves the state dict of PeftModel -> LoraModel (`base_model`) -> the transformers model (`model`).
constexpr const char* kPeftPrefix = "base_model.model.";

std::string lora_A_name(const std::string& key) { return kPeftPrefix + key + ".lora_A.weight"; }
std::string lora_B_name(const std::string& key) { return kPeftPrefix + key + ".lora_B.weight"; }
// DoRA's magnitude: peft saves its DoraLinearLayer's weight without the ".weight".
std::string magnitude_name(const std::string& key) { return kPeftPrefix + key + ".lora_magnitude_vector"; }

// A LoRA layer's trained tensors: a LoraLinear's (bare, or inside a QAT layer under the same name)
// or an expert bank's ExpertLora.
struct Adapter {
  std::string name;
  qat::LoraOptions options;
  torch::Tensor lora_A, lora_B, magnitude;  // magnitude: DoRA only
};

std::vector<Adapter> lora_layers(const torch::nn::Module& model) {
  std::vector<Adapter> layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto lora = std::dynamic_pointer_cast<qat::LoraLinear>(item.value());
    if (auto quantized = std::dynamic_pointer_cast<qat::QatLinear>(item.value())) {
      lora = std::dynamic_pointer_cast<qat::LoraLinear>(quantized->inner());
    }
    if (lora) layers.push_back({item.key(), lora->options(), lora->lora_A(), lora->lora_B(), lora->lora_magnitude()});
    if (auto bank = std::dynamic_pointer_cast<qat::ExpertLora>(item.value())) {
      layers.push_back({item.key(), bank->options(), bank->lora_A(), bank->lora_B(), torch::Tensor()});
    }
  }
  return layers;
}

std::vector<std::string> adapter_names(const std::vector<Adapter>& adapters) {
  std::vector<std::string> names;
  for (const auto& adapter : adapters) names.push_back(adapter.name);
  return names;
}

// One adapted layer as peft holds it. In a mixture-of-experts model peft adapts what sits in the
// feed-forward blocks as parameters (target_parameters: transformers 5 has no modules there for
// the experts, and rewrites MLP module names of target_modules into its fused ones), each wrapped
// around the module that holds it: the keys of the banks of one block nest, the first the block
// defines innermost (mlp.experts.base_layer.lora_A for gate_up_proj when down_proj is adapted too).
struct PeftLayer {
  std::string name;       // the module's path in the model
  std::string key;        // its path in peft's keys
  std::string parameter;  // under target_parameters: the parameter's name; empty under target_modules
  int64_t experts = 0;    // > 0: an expert bank
  // Where peft's lora_B rows differ from the bank's: published row i is the bank's row
  // published_rows[i] (gpt-oss's interleaved gate / up); undefined: the same order.
  torch::Tensor published_rows;
};

// Bank rows gate-first -> transformers' interleaved order (gate j, up j, ...), for `rows` rows.
torch::Tensor interleaved_rows(int64_t rows) {
  const auto half = torch::arange(rows / 2, torch::kInt64);
  return torch::stack({half, half + rows / 2}, 1).flatten();
}

std::vector<PeftLayer> peft_layers(const LlamaForCausalLMImpl& model, const std::vector<std::string>& adapted) {
  const bool experts_model = model.options().feed_forward == FeedForwardKind::kExperts;
  const auto banks = qat::expert_banks(model);
  std::vector<PeftLayer> layers;
  for (const auto& name : adapted) {
    const auto bank = banks.find(name);
    PeftLayer layer{name, name, "", bank == banks.end() ? 0 : bank->second, torch::Tensor()};
    const std::string gate_up = ".gate_up_proj";
    if (layer.experts > 0 && model.options().experts.interleaved_gate_up && name.size() > gate_up.size() &&
        name.compare(name.size() - gate_up.size(), gate_up.size(), gate_up) == 0) {
      layer.published_rows = interleaved_rows(2 * model.options().experts.intermediate_size);
    }
    if (layer.experts > 0) {
      layer.parameter = name;
      const std::string owner = name.substr(0, name.rfind('.'));
      layer.key = owner;
      bool after = false;
      for (const auto& child : model.named_modules("", /*include_self=*/false)) {
        const auto& child_name = child.key();
        const bool in_owner = child_name.size() > owner.size() + 1 && child_name.compare(0, owner.size() + 1, owner + ".") == 0 &&
                              child_name.find('.', owner.size() + 1) == std::string::npos;
        if (!in_owner) continue;
        if (child_name == name) {
          after = true;
        } else if (after && std::find(adapted.begin(), adapted.end(), child_name) != adapted.end()) {
          layer.key += ".base_layer";
        }
      }
    } else if (experts_model && name.find(".mlp.") != std::string::npos) {
      layer.parameter = name + ".weight";
    }
    layers.push_back(layer);
  }
  return layers;
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

std::string streamed_number(double value) {
  std::ostringstream text;
  text << value;
  return text.str();
}

}  // namespace

void apply_peft_adapter(LlamaForCausalLMImpl& model, const std::string& adapter_dir) {
  const auto config = read_peft_adapter_config(adapter_dir);
  const std::string config_path = (fs::path(adapter_dir) / kConfigFile).string();
  const std::string weights_path = (fs::path(adapter_dir) / kWeightsFile).string();
  if (!fs::exists(weights_path)) {
    if (fs::exists(fs::path(adapter_dir) / "adapter_model.bin")) {
      throw Error(ErrorCode::kAdapter, weights_path + ": not found, only a pickled adapter_model.bin; re-save the adapter with peft's "
                                 "save_pretrained(..., safe_serialization=True)");
    }
    throw Error(ErrorCode::kAdapter, weights_path + ": not found (the adapter's weights)");
  }
  if (!lora_layers(model).empty()) {
    throw Error(ErrorCode::kAdapter, adapter_dir + ": the model already has LoRA layers; apply one adapter to a plain base model");
  }

  // Check the whole file against the model before changing anything.
  const auto targets = qat::find_lora_targets(model, config.targets);
  if (targets.empty()) {
    throw Error(ErrorCode::kAdapter, config_path + ": target_modules " + config.targets.include.describe() +
                " matches no linear layer of the model (names look like 'model.layers.0.self_attn.q_proj')");
  }
  auto weights = SafetensorsCheckpoint::open(weights_path);
  std::set<std::string> expected;
  auto check = [&](const std::string& name, std::vector<int64_t> shape) {
    if (!weights.contains(name)) {
      throw Error(ErrorCode::kAdapter, weights_path + ": tensor '" + name + "' is missing (" + kConfigFile + " targets this module; expected shape " +
                  shape_text(shape) + ")");
    }
    const auto stored = weights.info(name).shape;
    if (std::vector<int64_t>(stored.begin(), stored.end()) != shape) {
      throw Error(ErrorCode::kAdapter, weights_path + ": tensor '" + name + "' has shape " + shape_text(stored) + ", expected " +
                  shape_text(shape) + " (r from " + kConfigFile + ", features from the model)");
    }
    expected.insert(name);
  };
  std::vector<std::string> target_names;
  for (const auto& target : targets) target_names.push_back(target.name);
  const auto keyed = peft_layers(model, target_names);
  for (size_t index = 0; index < targets.size(); ++index) {
    const auto& target = targets[index];
    const auto& key = keyed[index].key;
    const int64_t rank = config.options_for(target.name).rank;
    // An expert bank: A [experts · rank, in], B [each expert's rows, rank · experts].
    const int64_t experts = std::max<int64_t>(keyed[index].experts, 1);
    check(lora_A_name(key), {rank * experts, target.layer->in_features()});
    check(lora_B_name(key), {target.layer->out_features() / experts, rank * experts});
    if (config.options_for(target.name).dora) check(magnitude_name(key), {target.layer->out_features()});
  }
  std::vector<std::string> unexpected;
  for (const auto& name : weights.names()) {
    if (!expected.count(name)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string listed;
    for (size_t index = 0; index < unexpected.size() && index < 3; ++index) listed += " '" + unexpected[index] + "'";
    throw Error(ErrorCode::kAdapter, weights_path + ": " + std::to_string(unexpected.size()) + " tensor(s) that no target module of " +
                kConfigFile + " takes:" + listed + (unexpected.size() > 3 ? " ..." : "") + " (target_modules " +
                config.targets.include.describe() + ")");
  }

  qat::apply_lora(model, config.targets, [&](const std::string& name) { return config.options_for(name); });
  torch::NoGradGuard no_grad;
  const auto adapters = lora_layers(model);
  const auto applied = peft_layers(model, adapter_names(adapters));
  for (size_t index = 0; index < adapters.size(); ++index) {
    const auto& lora = adapters[index];
    const auto& key = applied[index].key;
    std::vector<std::pair<std::string, torch::Tensor>> parts = {{lora_A_name(key), lora.lora_A}, {lora_B_name(key), lora.lora_B}};
    if (lora.options.dora) parts.emplace_back(magnitude_name(key), lora.magnitude);
    for (const auto& [tensor_name, target] : parts) {
      auto stored = weights.tensor(tensor_name);
      const auto& rows = applied[index].published_rows;
      if (rows.defined() && tensor_name == lora_B_name(key)) stored = torch::empty_like(stored).index_copy_(0, rows, stored);
      if (!stored.is_floating_point()) {
        throw Error(ErrorCode::kAdapter, weights_path + ": tensor '" + tensor_name + "' has dtype " +
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
    throw Error(ErrorCode::kAdapter, out.string() + ": already exists; qtrain never overwrites an adapter (choose another directory or remove it)");
  }
  const auto layers = lora_layers(model);
  if (layers.empty()) throw Error(ErrorCode::kAdapter, out.string() + ": the model has no LoRA layers to write as a PEFT adapter");

  // The config must describe the model, or peft would build a different adapter from it.
  std::vector<std::string> wrapped, parameters;  // target_modules' and target_parameters' exact names
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const auto keyed = peft_layers(model, adapter_names(layers));
  for (size_t index = 0; index < layers.size(); ++index) {
    const auto& name = layers[index].name;
    const auto& key = keyed[index].key;
    const auto* lora = &layers[index];
    if (!config.targets.matches(name)) {
      throw Error(ErrorCode::kAdapter, out.string() + ": module '" + name + "' has a LoRA layer but target_modules " +
                  config.targets.include.describe() + " does not select it");
    }
    const auto expected = config.options_for(name);
    const auto& actual = lora->options;
    if (actual.rank != expected.rank || actual.alpha != expected.alpha || actual.rslora != expected.rslora ||
        actual.dora != expected.dora) {
      throw Error(ErrorCode::kAdapter, out.string() + ": module '" + name + "' has LoRA r=" + std::to_string(actual.rank) +
                  " alpha=" + streamed_number(actual.alpha) + (actual.rslora ? " (rsLoRA)" : "") + (actual.dora ? " (DoRA)" : "") +
                  " but the adapter config says r=" + std::to_string(expected.rank) + " alpha=" +
                  streamed_number(expected.alpha) + (expected.rslora ? " (rsLoRA)" : "") + (expected.dora ? " (DoRA)" : ""));
    }
    if (keyed[index].parameter.empty()) {
      wrapped.push_back(name);
    } else {
      parameters.push_back(keyed[index].parameter);
    }
    tensors.emplace_back(lora_A_name(key), lora->lora_A.detach().to(torch::kCPU, torch::kFloat32).contiguous());
    auto lora_B = lora->lora_B.detach().to(torch::kCPU, torch::kFloat32);
    if (keyed[index].published_rows.defined()) lora_B = lora_B.index_select(0, keyed[index].published_rows);
    tensors.emplace_back(lora_B_name(key), lora_B.contiguous());
    if (actual.dora) {
      tensors.emplace_back(magnitude_name(key), lora->magnitude.detach().to(torch::kCPU, torch::kFloat32).contiguous());
    }
  }
  const auto unwrapped = qat::find_lora_targets(model, config.targets);
  if (!unwrapped.empty()) {
    throw Error(ErrorCode::kAdapter, out.string() + ": module '" + unwrapped.front().name + "' matches target_modules " +
                config.targets.include.describe() + " but has no LoRA layer");
  }

  // Written in file order: with several matching patterns peft takes the first.
  Json rank_pattern = Json::object(), alpha_pattern = Json::object();
  for (const auto& [pattern, rank] : config.rank_pattern) rank_pattern[pattern] = rank;
  for (const auto& [pattern, alpha] : config.alpha_pattern) alpha_pattern[pattern] = alpha;
  Json target_modules, exclude_modules, target_parameters;
  if (!parameters.empty()) {
    // Exact names: peft would rewrite MLP names in target_modules into transformers 5's fused ones.
    target_modules = wrapped;
    target_parameters = parameters;
  } else if (peft_reads_targets_alike(config.targets)) {
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
  });
  if (!target_parameters.is_null()) json["target_parameters"] = target_parameters;
  json.update(Json{
      {"task_type", "CAUSAL_LM"},
      {"use_dora", config.lora.dora},
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
      if (!stream) throw Error(ErrorCode::kFileSystem, (staging / kConfigFile).string() + ": could not be written (disk full?)");
    }
    write_safetensors((staging / kWeightsFile).string(), tensors, {{"format", "pt"}});
    fs::rename(staging, out);
  } catch (const fs::filesystem_error& error) {
    remove_tree(staging.string());
    throw Error(ErrorCode::kFileSystem, out.string() + ": could not write the adapter (" + error.what() + ")");
  } catch (...) {
    remove_tree(staging.string());
    throw;
  }
}

}  // namespace qtrain::trainer
