#include "trainer/formats/compressed_tensors_config.h"

#include <nlohmann/json.hpp>
#include <regex>

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kQuantMethod = "compressed-tensors";
// The compressed-tensors release whose files these are (tools/setup.sh installs it).
constexpr const char* kVersion = "0.20.0";

[[noreturn]] void fail(const std::string& where, const std::string& message) {
  throw Error(ErrorCode::kModelConfig, where + ": " + message);
}

template <typename T>
T read(const nlohmann::json& object, const std::string& key, const std::string& where, T fallback) {
  if (!object.contains(key) || object.at(key).is_null()) return fallback;
  try {
    return object.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    fail(where + "." + key, "has the wrong type (" + object.at(key).dump() + ")");
  }
}

std::vector<std::string> read_names(const nlohmann::json& object, const std::string& key, const std::string& where) {
  if (!object.contains(key) || object.at(key).is_null()) return {};
  const auto& value = object.at(key);
  if (value.is_string()) return {value.get<std::string>()};
  if (!value.is_array()) fail(where + "." + key, "must be a list of module names or \"re:\" patterns");
  std::vector<std::string> names;
  for (const auto& entry : value) {
    if (!entry.is_string()) fail(where + "." + key, "must hold strings, found " + entry.dump());
    names.push_back(entry.get<std::string>());
  }
  return names;
}

std::optional<CompressedTensorsArgs> read_args(const nlohmann::json& group, const std::string& key, const std::string& where) {
  if (!group.contains(key) || group.at(key).is_null()) return std::nullopt;
  const auto& object = group.at(key);
  const std::string at = where + "." + key;
  if (!object.is_object()) fail(at, "must be an object of quantization arguments");
  CompressedTensorsArgs args;
  args.num_bits = read<int64_t>(object, "num_bits", at, args.num_bits);
  args.type = read<std::string>(object, "type", at, args.type);
  args.symmetric = read<bool>(object, "symmetric", at, args.symmetric);
  args.strategy = read<std::string>(object, "strategy", at, args.strategy);
  args.group_size = read<int64_t>(object, "group_size", at, 0);
  if (object.contains("dynamic") && object.at("dynamic").is_string()) {
    fail(at + ".dynamic", "'" + object.at("dynamic").get<std::string>() + "' (local dynamic scales) is not read");
  }
  args.dynamic = read<bool>(object, "dynamic", at, false);
  args.scale_dtype = read<std::string>(object, "scale_dtype", at, "");
  if (args.num_bits < 1 || args.num_bits > 8) fail(at + ".num_bits", std::to_string(args.num_bits) + " is not 1 to 8");
  if (args.type != "int" && args.type != "float") fail(at + ".type", "'" + args.type + "' is not int or float");
  if (read<std::string>(object, "actorder", at, "") != "" && args.strategy != "group") {
    fail(at + ".actorder", "is set for strategy " + args.strategy);
  }
  return args;
}

}  // namespace

bool is_compressed_tensors_config(const std::string& config_json) {
  const auto json = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object() || !json.contains("quantization_config")) return false;
  const auto& quantization = json.at("quantization_config");
  return quantization.is_object() && quantization.contains("quant_method") && quantization.at("quant_method").is_string() &&
         quantization.at("quant_method").get<std::string>() == kQuantMethod;
}

CompressedTensorsConfig parse_compressed_tensors_config(const std::string& config_json, const std::string& path) {
  const std::string where = path + ": quantization_config";
  const auto json = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object() || !json.contains("quantization_config") ||
      !json.at("quantization_config").is_object()) {
    fail(where, "is missing or not an object");
  }
  const auto& object = json.at("quantization_config");
  CompressedTensorsConfig config;
  config.format = read<std::string>(object, "format", where, "dense");
  const auto status = read<std::string>(object, "quantization_status", where, "compressed");
  if (status != "compressed") {
    fail(where + ".quantization_status", "is '" + status + "': qtrain reads compressed checkpoints (llm-compressor's "
         "save_pretrained with save_compressed=True, its default)");
  }
  for (const char* key : {"sparsity_config", "transform_config"}) {
    if (object.contains(key) && !object.at(key).is_null() && !object.at(key).empty()) {
      fail(where + "." + key, "is set: sparse and transformed (SpinQuant, QuIP) checkpoints are not read");
    }
  }
  if (object.contains("kv_cache_scheme") && !object.at("kv_cache_scheme").is_null()) {
    fail(where + ".kv_cache_scheme", "is set: a quantized KV cache is not something qtrain runs");
  }
  config.ignore = read_names(object, "ignore", where);
  if (!object.contains("config_groups") || !object.at("config_groups").is_object() || object.at("config_groups").empty()) {
    fail(where + ".config_groups", "must be an object of one or more scheme groups");
  }
  for (const auto& [name, group_json] : object.at("config_groups").items()) {
    const std::string at = where + ".config_groups." + name;
    if (!group_json.is_object()) fail(at, "must be an object");
    CompressedTensorsGroup group;
    group.name = name;
    group.targets = read_names(group_json, "targets", at);
    group.weights = read_args(group_json, "weights", at);
    group.input_activations = read_args(group_json, "input_activations", at);
    if (read_args(group_json, "output_activations", at)) {
      fail(at + ".output_activations", "is set: output activation quantization is not something qtrain runs");
    }
    group.format = read<std::string>(group_json, "format", at, config.format);
    config.groups.push_back(std::move(group));
  }
  return config;
}

bool compressed_tensors_target_matches(const std::string& target, const std::string& name) {
  if (target == "Linear") return true;  // the class of every linear module
  const std::string prefix = "re:";
  if (target.compare(0, prefix.size(), prefix) != 0) return target == name;
  try {
    // Python's re.match: anchored at the start, not at the end.
    return std::regex_search(name, std::regex(target.substr(prefix.size())), std::regex_constants::match_continuous);
  } catch (const std::regex_error&) {
    throw Error(ErrorCode::kModelConfig, "quantization_config: '" + target + "' is not a regular expression qtrain reads");
  }
}

const CompressedTensorsGroup* find_compressed_tensors_group(const CompressedTensorsConfig& config, const std::string& name) {
  for (const auto& ignored : config.ignore) {
    if (compressed_tensors_target_matches(ignored, name)) return nullptr;
  }
  for (const auto& group : config.groups) {
    for (const auto& target : group.targets) {
      if (compressed_tensors_target_matches(target, name)) return &group;
    }
  }
  return nullptr;
}

double compressed_tensors_stored_bytes(const CompressedTensorsConfig& config, const std::string& name, int64_t out,
                                       int64_t in, int64_t scale_bytes) {
  const auto* group = find_compressed_tensors_group(config, name);
  if (group == nullptr || !group->weights) return -1.0;
  const auto& args = *group->weights;
  const bool grouped = (args.strategy == "group" || args.strategy == "tensor_group") && args.group_size > 0;
  const double groups = args.strategy == "tensor" ? 1.0 : static_cast<double>(out) * (grouped ? static_cast<double>(in / args.group_size) : 1.0);
  const double elements = static_cast<double>(out) * static_cast<double>(in);
  if (group->format == "nvfp4-pack-quantized") return elements / 2 + groups + 4;  // e4m3 group scales, fp32 global
  const double words = [&] {  // pack-quantized: int32 words of `bits`-bit codes a row
    return static_cast<double>(out) * static_cast<double>((in * args.num_bits + 31) / 32) * 4;
  }();
  const bool packed = group->format == "pack-quantized";
  double bytes = (packed ? words : elements) + groups * static_cast<double>(scale_bytes);
  if (!args.symmetric) bytes += packed ? groups * static_cast<double>(args.num_bits) / 8 : groups;
  return bytes;
}

namespace {

const char* strategy_of(const qat::QuantPresetGrid& grid, bool two_level) {
  const std::string granularity = grid.granularity;
  if (granularity == "per_group") return two_level ? "tensor_group" : "group";
  if (granularity == "per_channel") return "channel";
  if (granularity == "per_token") return "token";
  return "tensor";
}

// The keys compressed-tensors writes for a preset's arguments (the ones it sets), sorted as it
// sorts them.
nlohmann::ordered_json args_json(const qat::QuantPresetGrid& grid, bool dynamic, bool two_level) {
  nlohmann::ordered_json args;
  args["dynamic"] = dynamic;
  args["group_size"] = grid.group_size > 0 ? nlohmann::ordered_json(grid.group_size) : nlohmann::ordered_json(nullptr);
  args["num_bits"] = grid.bits;
  if (two_level) args["scale_dtype"] = "torch.float8_e4m3fn";
  args["strategy"] = strategy_of(grid, two_level);
  args["symmetric"] = grid.symmetric;
  args["type"] = grid.format == qat::QuantFormat::kInt ? "int" : "float";
  return args;
}

}  // namespace

std::string compressed_tensors_config_json(const qat::QuantPreset& preset, const std::vector<std::string>& ignore) {
  nlohmann::ordered_json group;
  group["format"] = preset.compression_format;
  group["input_activations"] =
      preset.quantizes_activations ? args_json(preset.activations, true, false) : nlohmann::ordered_json(nullptr);
  group["output_activations"] = nullptr;
  group["targets"] = {"Linear"};
  group["weights"] = args_json(preset.weights, false, preset.two_level_scales);
  nlohmann::ordered_json config;
  config["config_groups"] = {{"group_0", group}};
  config["format"] = preset.compression_format;
  config["global_compression_ratio"] = nullptr;
  config["ignore"] = ignore;
  config["kv_cache_scheme"] = nullptr;
  config["moe_sparsity_config"] = nullptr;
  config["quant_method"] = kQuantMethod;
  config["quantization_status"] = "compressed";
  config["sparsity_config"] = nlohmann::ordered_json::object();
  config["transform_config"] = nlohmann::ordered_json::object();
  config["version"] = kVersion;
  return config.dump();
}

}  // namespace qtrain::trainer
