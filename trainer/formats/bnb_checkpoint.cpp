#include "trainer/formats/bnb_checkpoint.h"

#include <nlohmann/json.hpp>
#include <functional>
#include <set>
#include <sstream>

#include "kernels/error.h"
#include "qat/four_bit_linear.h"
#include "qat/int8_linear.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace {

using nlohmann::json;

const std::string kQuantStateKey = ".weight.quant_state.bitsandbytes__";

// The quant-state JSON stored as a uint8 tensor, whichever 4-bit type its key names.
std::string quant_state_key(const SafetensorsCheckpoint& weights, const std::string& module_name) {
  for (const char* type : {"nf4", "fp4"}) {
    const std::string key = module_name + kQuantStateKey + type;
    if (weights.contains(key)) return key;
  }
  return "";
}

}  // namespace

std::optional<BnbQuantizationConfig> read_bnb_quantization_config(const HfModelConfig& config) {
  if (!config.has_quantization_config) return std::nullopt;
  const json object = quantization_config_json(config);
  if (object.is_null() || object.value("quant_method", std::string()) != "bitsandbytes") return std::nullopt;
  const std::string where = config.path + ": quantization_config.";
  auto flag = [&](const std::string& key) {
    if (!object.contains(key) || object.at(key).is_null()) return false;
    if (!object.at(key).is_boolean()) throw Error(ErrorCode::kModelConfig, where + key + " must be true or false, got " + object.at(key).dump());
    return object.at(key).get<bool>();
  };
  auto text = [&](const std::string& key, const std::string& fallback) {
    if (!object.contains(key) || object.at(key).is_null()) return fallback;
    if (!object.at(key).is_string()) throw Error(ErrorCode::kModelConfig, where + key + " must be a string, got " + object.at(key).dump());
    return object.at(key).get<std::string>();
  };
  BnbQuantizationConfig result;
  result.load_in_4bit = flag("load_in_4bit") || flag("_load_in_4bit");
  result.load_in_8bit = flag("load_in_8bit") || flag("_load_in_8bit");
  result.quant_type = text("bnb_4bit_quant_type", "fp4");
  if (object.contains("llm_int8_threshold") && !object.at("llm_int8_threshold").is_null()) {
    if (!object.at("llm_int8_threshold").is_number() || object.at("llm_int8_threshold").get<double>() < 0) {
      throw Error(ErrorCode::kModelConfig, where + "llm_int8_threshold must be a number >= 0, got " + object.at("llm_int8_threshold").dump());
    }
    result.llm_int8_threshold = object.at("llm_int8_threshold").get<double>();
  }
  result.double_quant = flag("bnb_4bit_use_double_quant");
  result.compute_dtype = parse_dtype_name(text("bnb_4bit_compute_dtype", "float32"), where + "bnb_4bit_compute_dtype",
                                            ErrorCode::kModelConfig);
  const std::string storage = text("bnb_4bit_quant_storage", "uint8");
  if (result.load_in_4bit && storage != "uint8") {
    throw Error(ErrorCode::kModelConfig, where + "bnb_4bit_quant_storage '" + storage + "' is not supported (only uint8)");
  }
  if (result.load_in_4bit) qat::parse_four_bit_type(result.quant_type, where + "bnb_4bit_quant_type", ErrorCode::kModelConfig);
  if (object.contains("llm_int8_skip_modules") && !object.at("llm_int8_skip_modules").is_null()) {
    const auto& skip = object.at("llm_int8_skip_modules");
    if (!skip.is_array()) throw Error(ErrorCode::kModelConfig, where + "llm_int8_skip_modules must be a list of module names");
    for (const auto& name : skip) {
      if (!name.is_string()) throw Error(ErrorCode::kModelConfig, where + "llm_int8_skip_modules must be a list of module names");
      result.skip_modules.push_back(name.get<std::string>());
    }
  }
  return result;
}

bool is_bnb_4bit_checkpoint(const HfModelConfig& config) {
  const auto bnb = read_bnb_quantization_config(config);
  return bnb && bnb->load_in_4bit;
}

bool is_bnb_8bit_checkpoint(const HfModelConfig& config) {
  const auto bnb = read_bnb_quantization_config(config);
  return bnb && bnb->load_in_8bit;
}

qat::FourBitTensor read_bnb_4bit_weight(const SafetensorsCheckpoint& weights, const std::string& module_name,
                                        const std::string& source) {
  const std::string weight_name = module_name + ".weight";
  const std::string state_key = quant_state_key(weights, module_name);
  if (state_key.empty()) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + weight_name + ".quant_state.bitsandbytes__nf4' (or __fp4) is missing");
  }
  const auto state_bytes = weights.tensor(state_key).contiguous();
  if (state_bytes.scalar_type() != torch::kUInt8) throw Error(ErrorCode::kWeights, source + ": tensor '" + state_key + "' must be uint8");
  const std::string state_text(reinterpret_cast<const char*>(state_bytes.data_ptr<uint8_t>()), state_bytes.numel());
  json state_json;
  try {
    state_json = json::parse(state_text);
  } catch (const json::exception& error) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + state_key + "' is not the JSON of a bitsandbytes quant state (" +
                error.what() + ")");
  }
  const std::string where = source + ": " + state_key;
  auto required = [&](const std::string& key) -> const json& {
    if (!state_json.contains(key)) throw Error(ErrorCode::kWeights, where + ": the quant state has no '" + key + "'");
    return state_json.at(key);
  };
  auto tensor = [&](const std::string& name) {
    if (!weights.contains(name)) throw Error(ErrorCode::kWeights, source + ": tensor '" + name + "' is missing");
    return weights.tensor(name);
  };

  qat::FourBitTensor result;
  auto& state = result.state;
  try {
    state.quant_type = qat::parse_four_bit_type(required("quant_type").get<std::string>(), where, ErrorCode::kWeights);
    state.blocksize = required("blocksize").get<int64_t>();
    state.shape = required("shape").get<std::vector<int64_t>>();
    state.dtype = parse_dtype_name(required("dtype").get<std::string>(), where + ": dtype");
  } catch (const json::exception& error) {
    throw Error(ErrorCode::kWeights, where + ": malformed quant state (" + error.what() + ")");
  }
  if (state.shape.size() != 2) throw Error(ErrorCode::kWeights, where + ": expected a 2-d weight shape, got " + shape_text(state.shape));
  result.packed = tensor(weight_name);
  state.code = tensor(weight_name + ".quant_map").to(torch::kFloat32);
  state.absmax = tensor(weight_name + ".absmax");
  if (weights.contains(weight_name + ".nested_absmax")) {
    state.nested_absmax = tensor(weight_name + ".nested_absmax");
    state.nested_code = tensor(weight_name + ".nested_quant_map");
    const int64_t nested_blocksize = state_json.value("nested_blocksize", qat::kNestedBlocksize);
    if (nested_blocksize != qat::kNestedBlocksize) {
      throw Error(ErrorCode::kWeights, where + ": nested_blocksize " + std::to_string(nested_blocksize) + " is not supported (only 256)");
    }
    if (!state_json.contains("nested_offset")) throw Error(ErrorCode::kWeights, where + ": the quant state has no 'nested_offset'");
    state.offset = state_json.at("nested_offset").get<float>();
  }
  state.check(result.packed, source + ": " + weight_name);
  const auto expected_code = qat::four_bit_code_tensor(state.quant_type);
  if (!torch::equal(state.code, expected_code)) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + weight_name + ".quant_map' is not bitsandbytes' " +
                qat::four_bit_type_name(state.quant_type) + " table");
  }
  return result;
}

namespace {


}  // namespace

LoadedModel load_bnb_4bit_llama(const std::string& model_dir, const HfModelConfig& config,
                                const ModelLoadOptions& options) {
  const auto bnb = read_bnb_quantization_config(config);
  if (!bnb || !bnb->load_in_4bit) throw Error(ErrorCode::kModelConfig, config.path + ": not a bitsandbytes 4-bit checkpoint");
  auto weights = SafetensorsCheckpoint::open(model_dir);
  // Projections with a stored quant state become FourBitLinear holding the stored bytes.
  return load_quantized_llama(
      model_dir, config, options, weights,
      [&](const std::string& name, const qat::DenseLinearOptions& dense,
          std::set<std::string>& used) -> std::shared_ptr<qat::LinearLayer> {
        const std::string state_key = quant_state_key(weights, name);
        if (state_key.empty()) return nullptr;
        auto quantized = read_bnb_4bit_weight(weights, name, model_dir);
        if (quantized.state.shape != std::vector<int64_t>{dense.out_features, dense.in_features}) {
          throw Error(ErrorCode::kWeights, model_dir + ": tensor '" + name + ".weight' has shape " + shape_text(quantized.state.shape) +
                      ", config.json expects " + shape_text({dense.out_features, dense.in_features}));
        }
        const auto bias = read_bias(weights, name, dense, model_dir, used);
        for (const char* suffix : {".weight", ".weight.absmax", ".weight.quant_map", ".weight.nested_absmax",
                                   ".weight.nested_quant_map"}) {
          used.insert(name + suffix);
        }
        used.insert(state_key);
        return std::make_shared<qat::FourBitLinear>(std::move(quantized), bias, options.dtype);
      });
}

std::shared_ptr<qat::Int8Linear> read_bnb_8bit_linear(const SafetensorsCheckpoint& weights,
                                                      const std::string& module_name, const std::vector<int64_t>& shape,
                                                      const torch::Tensor& bias, double threshold,
                                                      torch::ScalarType compute_dtype, const std::string& source) {
  const std::string weight_name = module_name + ".weight";
  const std::string scale_name = module_name + ".SCB";
  const std::string format_name = module_name + ".weight_format";
  if (!weights.contains(weight_name)) throw Error(ErrorCode::kWeights, source + ": tensor '" + weight_name + "' is missing");
  const auto codes = weights.tensor(weight_name);
  if (codes.scalar_type() != torch::kChar) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + weight_name + "' has dtype " + std::string(c10::toString(codes.scalar_type())) +
                ", a load_in_8bit checkpoint stores int8 weights");
  }
  if (codes.sizes() != c10::IntArrayRef(shape)) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + weight_name + "' has shape " + shape_text(codes.sizes()) +
                ", config.json expects int8 " + shape_text(shape));
  }
  if (!weights.contains(scale_name)) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + scale_name + "' is missing: the int8 weight '" + weight_name +
                "' needs its row absmax (fp32 [" + std::to_string(shape[0]) +
                "]); is the checkpoint complete (all shards)?");
  }
  const auto absmax = weights.tensor(scale_name);
  if (absmax.scalar_type() != torch::kFloat32 || absmax.dim() != 1 || absmax.size(0) != shape[0]) {
    throw Error(ErrorCode::kWeights, source + ": tensor '" + scale_name + "' has " + std::string(c10::toString(absmax.scalar_type())) +
                " " + shape_text(absmax.sizes()) + ", expected fp32 [" + std::to_string(shape[0]) +
                "] (one absmax per row of '" + weight_name + "')");
  }
  if (weights.contains(format_name)) {
    const auto format = weights.tensor(format_name);
    if (format.numel() != 1 || format.to(torch::kLong).item<int64_t>() != 0) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + format_name +
                  "' is not 0: only row-major int8 weights are supported (bitsandbytes >= 0.45 writes these)");
    }
  }
  return std::make_shared<qat::Int8Linear>(codes, absmax, bias, threshold, compute_dtype, source + ": " + module_name);
}

LoadedModel load_bnb_8bit_llama(const std::string& model_dir, const HfModelConfig& config,
                                const ModelLoadOptions& options) {
  const auto bnb = read_bnb_quantization_config(config);
  if (!bnb || !bnb->load_in_8bit) throw Error(ErrorCode::kModelConfig, config.path + ": not a bitsandbytes 8-bit checkpoint");
  auto weights = SafetensorsCheckpoint::open(model_dir);
  // Projections stored as int8 (or with an SCB) become Int8Linear holding the stored codes.
  return load_quantized_llama(
      model_dir, config, options, weights,
      [&](const std::string& name, const qat::DenseLinearOptions& dense,
          std::set<std::string>& used) -> std::shared_ptr<qat::LinearLayer> {
        const bool int8_weight =
            weights.contains(name + ".weight") && weights.info(name + ".weight").dtype == "I8";
        if (!int8_weight && !weights.contains(name + ".SCB")) return nullptr;
        const auto bias = read_bias(weights, name, dense, model_dir, used);
        auto layer = read_bnb_8bit_linear(weights, name, {dense.out_features, dense.in_features}, bias,
                                          bnb->llm_int8_threshold, options.dtype, model_dir);
        for (const char* suffix : {".weight", ".SCB", ".weight_format"}) used.insert(name + suffix);
        return layer;
      });
}

}  // namespace qtrain::trainer
