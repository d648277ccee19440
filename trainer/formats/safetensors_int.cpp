#include "trainer/formats/safetensors_int.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "data/text_affixes.h"
#include "kernels/error.h"
#include "qat/gguf_grid.h"
#include "qat/input_quantized_linear.h"
#include "qat/qat_linear.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace {

using data::ends_with;

constexpr const char* kIntQuantMethod = "qtrain";
constexpr const char* kMetadataKey = "qtrain.quantization";
constexpr const char* kIntScaleSuffix = ".weight_scale";
constexpr const char* kZeroPointSuffix = ".weight_zero_point";
// Format gguf: `weight` holds the layer's GGUF blocks as bytes, [rows, bytes of a row's blocks],
// and this int32 [1] the block type's ggml id (a file type's mix gives layers different types).
constexpr const char* kGgufTypeSuffix = ".weight_gguf_type";

const char* scale_dtype_name(torch::ScalarType dtype) { return dtype == torch::kFloat16 ? "float16" : "float32"; }

nlohmann::ordered_json spec_json(const qat::QuantSpec& spec) {
  nlohmann::ordered_json json;
  json["format"] = qat::quant_format_name(spec.format);
  json["bits"] = spec.bits;
  json["symmetric"] = spec.symmetric;
  json["granularity"] = qat::granularity_name(spec.granularity);
  json["group_size"] = spec.group_size;
  json["scale_dtype"] = scale_dtype_name(spec.scale_dtype);
  json["zero_point_domain"] = qat::zero_point_domain_name(spec.zero_point_domain);
  return json;
}

// Reads one key of quantization_config.<section>, an Error naming it when absent or mistyped.
template <typename T>
T required(const nlohmann::json& section, const std::string& key, const std::string& what) {
  if (!section.contains(key)) throw Error(ErrorCode::kModelConfig, what + "." + key + " is missing");
  try {
    return section.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw Error(ErrorCode::kModelConfig, what + "." + key + " has the wrong type (" + section.at(key).dump() + ")");
  }
}

qat::QuantSpec spec_from_json(const nlohmann::json& json, const std::string& what) {
  if (!json.is_object()) throw Error(ErrorCode::kModelConfig, what + " must be an object describing a quantization scheme");
  qat::QuantSpec spec;
  try {
    spec.format = qat::parse_quant_format(required<std::string>(json, "format", what), what + ".format");
    spec.bits = required<int64_t>(json, "bits", what);
    spec.symmetric = required<bool>(json, "symmetric", what);
    spec.granularity = qat::parse_granularity(required<std::string>(json, "granularity", what), what + ".granularity");
    spec.group_size = required<int64_t>(json, "group_size", what);
    const auto scale_dtype = required<std::string>(json, "scale_dtype", what);
    if (scale_dtype != "float16" && scale_dtype != "float32") {
      throw Error(ErrorCode::kModelConfig, what + ".scale_dtype: '" + scale_dtype + "' is not float16 or float32");
    }
    spec.scale_dtype = scale_dtype == "float16" ? torch::kFloat16 : torch::kFloat32;
    // Absent from files written before the float zero point existed: they all have integer ones.
    spec.zero_point_domain = qat::parse_zero_point_domain(json.value("zero_point_domain", "int"), what + ".zero_point_domain");
    spec.validate(what);
  } catch (const Error& error) {
    // The shared scheme checks speak of recipe keys; this scheme is config.json's.
    throw Error(ErrorCode::kModelConfig, error.what());
  }
  return spec;
}

// The quantization_config of a model whose QAT layers all share one scheme.
nlohmann::ordered_json quantization_config(
    const std::vector<std::pair<std::string, std::shared_ptr<qat::QatLinear>>>& layers) {
  const auto& first = *layers.front().second;
  const auto weights = first.weight_fake_quant().spec();
  const auto* activations = first.activation_fake_quant();
  if (weights.is_gguf_block()) {
    // Each layer's block type is its own tensor; the scheme is the format.
    for (const auto& [name, layer] : layers) {
      if (!layer->weight_fake_quant().spec().is_gguf_block() || layer->activation_fake_quant() != nullptr) {
        throw Error(ErrorCode::kRecipe, "safetensors-int export: layer '" + name + "' is quantized differently from '" +
                    layers.front().first + "'; the format holds one scheme per model");
      }
    }
    nlohmann::ordered_json config;
    config["quant_method"] = kIntQuantMethod;
    config["weights"] = {{"format", qat::quant_format_name(qat::QuantFormat::kGguf)}};
    config["activations"] = nullptr;
    return config;
  }
  for (const auto& [name, layer] : layers) {
    const auto* layer_activations = layer->activation_fake_quant();
    if (layer->weight_fake_quant().spec().describe() != weights.describe() ||
        (layer_activations == nullptr) != (activations == nullptr) ||
        (activations && layer_activations->spec().describe() != activations->spec().describe())) {
      throw Error(ErrorCode::kRecipe, "safetensors-int export: layer '" + name + "' is quantized differently from '" +
                  layers.front().first + "'; the format holds one scheme per model");
    }
  }
  nlohmann::ordered_json config;
  config["quant_method"] = kIntQuantMethod;
  config["weights"] = spec_json(weights);
  if (activations) {
    const auto& options = activations->options();
    if (options.observer != qat::ObserverKind::kDynamic || options.learned_scale) {
      throw Error(ErrorCode::kRecipe, activations->what() + ": safetensors-int export holds dynamic activation quantization only "
                  "(observer: dynamic, no learned scale); this model's activation scale is state ('" +
                  qat::observer_kind_name(options.observer) + "'" + (options.learned_scale ? ", learned" : "") +
                  ") the format cannot store yet");
    }
    config["activations"] = spec_json(activations->spec());
    config["activations"]["observer"] = qat::observer_kind_name(options.observer);
  } else {
    config["activations"] = nullptr;
  }
  return config;
}

// Integer zero points are int8; a float zero point's offsets m are fp32 (qat/quant_spec.h).
torch::ScalarType zero_point_dtype(const qat::QuantSpec& spec) {
  return spec.has_integer_zero_point() ? torch::kInt8 : torch::kFloat32;
}

}  // namespace

void write_quantized_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_dir,
                           const QuantizedExportOptions& options) {
  const auto layers = qat::find_qat_layers(model);
  if (layers.empty()) {
    throw Error(ErrorCode::kUsage, "safetensors-int export: the model has no QAT layers (it was not trained with quant: qat); "
                "export it with --format merged");
  }
  const auto scheme = quantization_config(layers);
  std::map<std::string, std::shared_ptr<qat::QatLinear>> by_weight;
  for (const auto& [name, layer] : layers) by_weight[name + ".weight"] = layer;

  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (auto& [name, tensor] : merged_weights(model, options.dtype)) {
    const auto layer = by_weight.find(name);
    if (layer == by_weight.end()) {
      tensors.emplace_back(name, std::move(tensor));
      continue;
    }
    if (layer->second->weight_fake_quant().spec().is_gguf_block()) {
      const auto grid = layer->second->convert_gguf_grid();
      auto bytes = qat::encode_gguf_grid(grid);
      const int64_t rows = grid.codes.size(0);
      const auto row_bytes = static_cast<int64_t>(bytes.size()) / rows;
      tensors.emplace_back(name, torch::from_blob(bytes.data(), {rows, row_bytes}, torch::kUInt8).clone());
      const auto type_id = static_cast<int32_t>(qat::gguf_block_format(grid.type).ggml_type);
      tensors.emplace_back(name.substr(0, name.size() - std::string(".weight").size()) + kGgufTypeSuffix,
                           torch::full({1}, type_id, torch::kInt32));
      continue;
    }
    const auto quantized = layer->second->convert();
    const auto& spec = quantized.spec;
    const auto prefix = name.substr(0, name.size() - std::string(".weight").size());
    tensors.emplace_back(name, quantized.codes.to(torch::kCPU, spec.is_integer() ? torch::kInt8 : torch::kUInt8));
    tensors.emplace_back(prefix + kIntScaleSuffix, quantized.params.scale.to(torch::kCPU, spec.scale_dtype));
    if (!spec.symmetric) {
      tensors.emplace_back(prefix + kZeroPointSuffix, quantized.params.zero_point.to(torch::kCPU, zero_point_dtype(spec)));
    }
  }
  write_safetensors_checkpoint(out_dir, tensors, options.max_shard_bytes,
                               {{"format", "pt"}, {kMetadataKey, scheme.dump()}});
  auto config = nlohmann::ordered_json::parse(merged_config_json(base.config, options.dtype));
  config["quantization_config"] = scheme;
  write_file_atomically(out_dir + "/config.json", config.dump(2) + "\n");
  write_generation_config_and_tokenizer(base, out_dir);
}

bool is_qtrain_quantized_checkpoint(const HfModelConfig& config) {
  if (!config.has_quantization_config) return false;
  const auto json = nlohmann::json::parse(config.json, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.contains("quantization_config")) return false;
  const auto& quantization = json.at("quantization_config");
  return quantization.is_object() && quantization.value("quant_method", "") == kIntQuantMethod;
}

namespace {

// Integer and float grids: every `NAME.weight_scale` names a layer whose `NAME.weight` holds its
// codes (+ `NAME.weight_zero_point`); each is dequantized as convert does into the model's weight.
// Returns the layers.
std::vector<std::string> load_integer_weights(const SafetensorsCheckpoint& weights, std::map<std::string, torch::Tensor>& parameters,
                                              const qat::QuantSpec& weight_spec, const std::string& what,
                                              std::set<std::string>& loaded_elsewhere) {
  std::vector<std::string> quantized_layers;
  for (const auto& scale_name : weights.names()) {
    if (!ends_with(scale_name, kIntScaleSuffix)) continue;
    const auto layer = scale_name.substr(0, scale_name.size() - std::string(kIntScaleSuffix).size());
    const auto weight_name = layer + ".weight";
    const auto target = parameters.find(weight_name);
    if (target == parameters.end()) {
      throw Error(ErrorCode::kWeights, weights.source() + ": '" + scale_name + "' belongs to no linear layer of the model (no '" +
                  weight_name + "')");
    }
    const auto codes = weights.tensor(weight_name);
    const auto expected_codes = weight_spec.is_integer() ? torch::kInt8 : torch::kUInt8;
    if (codes.scalar_type() != expected_codes || codes.sizes() != target->second.sizes()) {
      throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + weight_name + "' should hold " +
                  std::string(c10::toString(expected_codes)) + " codes of shape " +
                  shape_text(target->second.sizes()) + ", found " + std::string(c10::toString(codes.scalar_type())) +
                  " " + shape_text(codes.sizes()));
    }
    weight_spec.validate_for_shape(what + ".weights", codes.sizes());
    const auto params_shape = qat::params_shape(weight_spec, codes.sizes());
    auto check_params = [&](const std::string& name, const torch::Tensor& tensor) {
      if (tensor.sizes() != c10::IntArrayRef(params_shape)) {
        throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + name + "' has shape " + shape_text(tensor.sizes()) + ", the " +
                    weight_spec.describe() + " scheme of " + shape_text(codes.sizes()) + " expects " +
                    shape_text(params_shape));
      }
    };
    qat::QuantizedTensor quantized;
    quantized.spec = weight_spec;
    quantized.codes = codes;
    const auto scale = weights.tensor(scale_name);
    check_params(scale_name, scale);
    quantized.params.scale = scale.to(torch::kFloat32);
    const auto zero_point_name = layer + kZeroPointSuffix;
    if (weight_spec.symmetric) {
      if (weights.contains(zero_point_name)) {
        throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + zero_point_name + "' is present but the scheme is symmetric");
      }
      quantized.params.zero_point = torch::zeros(params_shape, torch::kFloat32);
    } else {
      if (!weights.contains(zero_point_name)) {
        throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + zero_point_name + "' is missing (the " + weight_spec.describe() +
                    " scheme is asymmetric, so every quantized weight needs its zero points, shape " +
                    shape_text(params_shape) + ")");
      }
      const auto zero_point = weights.tensor(zero_point_name);
      check_params(zero_point_name, zero_point);
      if (zero_point.scalar_type() != zero_point_dtype(weight_spec)) {
        throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + zero_point_name + "' is " +
                    std::string(c10::toString(zero_point.scalar_type())) + ", the " + weight_spec.describe() + " scheme stores " +
                    std::string(c10::toString(zero_point_dtype(weight_spec))) + " zero points");
      }
      quantized.params.zero_point = zero_point.to(torch::kFloat32);
      loaded_elsewhere.insert(zero_point_name);
    }
    target->second.copy_(quantized.dequantize());
    loaded_elsewhere.insert(weight_name);
    loaded_elsewhere.insert(scale_name);
    quantized_layers.push_back(layer);
  }
  return quantized_layers;
}

// Format gguf: every `NAME.weight_gguf_type` names a layer whose `NAME.weight` holds its GGUF
// blocks; each is dequantized as ggml does into the model's weight. Returns the layers.
std::vector<std::string> load_gguf_block_weights(const SafetensorsCheckpoint& weights, std::map<std::string, torch::Tensor>& parameters,
                                                 std::set<std::string>& loaded_elsewhere) {
  std::vector<std::string> layers;
  for (const auto& type_name : weights.names()) {
    if (!ends_with(type_name, kGgufTypeSuffix)) continue;
    const auto layer = type_name.substr(0, type_name.size() - std::string(kGgufTypeSuffix).size());
    const auto weight_name = layer + ".weight";
    const auto target = parameters.find(weight_name);
    if (target == parameters.end() || target->second.dim() != 2) {
      throw Error(ErrorCode::kWeights, weights.source() + ": '" + type_name + "' belongs to no linear layer of the model (no '" +
                  weight_name + "')");
    }
    const auto type_id = weights.tensor(type_name);
    const auto* format = type_id.scalar_type() == torch::kInt32 && type_id.numel() == 1
                             ? qat::gguf_block_format_by_id(static_cast<uint32_t>(type_id.item<int32_t>()))
                             : nullptr;
    if (format == nullptr || format->dequantize == nullptr) {
      throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + type_name + "' should hold the int32 ggml id of a quantized "
                  "GGUF block type, found " + std::string(c10::toString(type_id.scalar_type())) + " " + shape_text(type_id.sizes()));
    }
    const int64_t rows = target->second.size(0);
    const int64_t cols = target->second.size(1);
    const auto bytes = weights.tensor(weight_name).contiguous();
    if (cols % format->block_elements != 0 || bytes.scalar_type() != torch::kUInt8 ||
        bytes.sizes() != c10::IntArrayRef({rows, cols / format->block_elements * format->block_bytes})) {
      throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + weight_name + "' should hold the " + format->name +
                  " blocks of a [" + std::to_string(rows) + ", " + std::to_string(cols) + "] weight as uint8 [" +
                  std::to_string(rows) + ", " + std::to_string(cols / std::max<int64_t>(format->block_elements, 1) * format->block_bytes) +
                  "], found " + std::string(c10::toString(bytes.scalar_type())) + " " + shape_text(bytes.sizes()));
    }
    auto values = torch::empty({rows, cols}, torch::kFloat32);
    format->dequantize(bytes.data_ptr<uint8_t>(), values.data_ptr<float>(), values.numel());
    target->second.copy_(values);
    loaded_elsewhere.insert(weight_name);
    loaded_elsewhere.insert(type_name);
    layers.push_back(layer);
  }
  return layers;
}

}  // namespace

LoadedModel load_qtrain_quantized_llama(const std::string& model_dir, const HfModelConfig& config,
                                        const ModelLoadOptions& options) {
  const std::string what = config.path + ": quantization_config";
  const auto quantization = nlohmann::json::parse(config.json).at("quantization_config");
  const auto weights_section = quantization.value("weights", nlohmann::json());
  const bool gguf_blocks =
      weights_section.is_object() && weights_section.value("format", "") == qat::quant_format_name(qat::QuantFormat::kGguf);
  const auto weight_spec = gguf_blocks ? qat::QuantSpec() : spec_from_json(weights_section, what + ".weights");
  std::optional<qat::FakeQuantizerOptions> activations;
  if (quantization.contains("activations") && !quantization.at("activations").is_null()) {
    const auto& section = quantization.at("activations");
    qat::FakeQuantizerOptions activation_options;
    activation_options.spec = spec_from_json(section, what + ".activations");
    activation_options.observer = qat::parse_observer_kind(section.value("observer", "dynamic"), what + ".activations.observer");
    if (activation_options.observer != qat::ObserverKind::kDynamic) {
      throw Error(ErrorCode::kModelConfig, what + ".activations.observer: only 'dynamic' activation scales can be loaded");
    }
    activations = activation_options;
  }

  LoadedModel loaded;
  loaded.config = config;
  loaded.model = LlamaForCausalLM(config.llama, options.dtype, dense_linear_factory());
  const auto weights = SafetensorsCheckpoint::open(model_dir);
  std::map<std::string, torch::Tensor> parameters;
  for (auto& item : loaded.model->named_parameters(/*recurse=*/true)) parameters[item.key()] = item.value();

  torch::NoGradGuard no_grad;
  std::set<std::string> loaded_elsewhere;
  const auto quantized_layers = gguf_blocks ? load_gguf_block_weights(weights, parameters, loaded_elsewhere)
                                            : load_integer_weights(weights, parameters, weight_spec, what, loaded_elsewhere);
  if (quantized_layers.empty()) {
    throw Error(ErrorCode::kWeights, weights.source() + ": config.json says the model is quantized (quant_method qtrain) but no tensor "
                "ends in '" + (gguf_blocks ? kGgufTypeSuffix : kIntScaleSuffix) + "'");
  }
  load_state(*loaded.model, weights, model_dir, config.llama.tie_word_embeddings, loaded_elsewhere);

  if (activations) {
    std::map<std::string, std::shared_ptr<qat::LinearLayer>> linear_layers;
    for (const auto& item : loaded.model->named_modules("", /*include_self=*/false)) {
      if (auto linear = std::dynamic_pointer_cast<qat::LinearLayer>(item.value())) linear_layers[item.key()] = linear;
    }
    for (const auto& layer : quantized_layers) {
      auto wrapped = std::make_shared<qat::InputQuantizedLinear>(linear_layers.at(layer), *activations,
                                                                 what + ".activations");
      qat::replace_linear_layer_at(*loaded.model, layer, wrapped);
    }
  }
  loaded.model->to(options.device);
  loaded.model->eval();
  return loaded;
}

}  // namespace qtrain::trainer
