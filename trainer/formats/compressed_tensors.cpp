#include "trainer/formats/compressed_tensors.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "data/text_affixes.h"
#include "kernels/error.h"
#include "qat/compressed_linear.h"
#include "qat/input_quantized_linear.h"
#include "qat/qat_linear.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/compressed_tensors_config.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace {

using data::ends_with;

constexpr const char* kOutputHead = "lm_head";

// The outermost linear layers (an adapter with its base is one), by name.
std::map<std::string, std::shared_ptr<qat::LinearLayer>> linear_layers(const LlamaForCausalLMImpl& model) {
  std::map<std::string, std::shared_ptr<qat::LinearLayer>> layers;
  const auto all = [](const auto&...) { return true; };
  for (auto& found : qat::find_linear_layers(model, all, all)) layers[found.name] = found.layer;
  return layers;
}

// Whether `preset` can round a weight of `in_features` (its groups divide it).
bool preset_fits(const qat::QuantPreset& preset, int64_t in_features) {
  const int64_t group = preset.weights.group_size;
  return std::string(preset.weights.granularity) != "per_group" || (group > 0 && in_features % group == 0);
}

// A QAT layer's trained codes in the stored form, when it trained on `preset`'s grid.
qat::CompressedWeight trained_weight(const std::string& name, const qat::QatLinear& layer, const qat::QuantPreset& preset,
                                     torch::ScalarType dtype) {
  const auto trained = layer.weight_fake_quant().spec();
  const auto expected = qat::QuantSpec::compressed_tensors_weights(preset);
  if (trained.describe() != expected.describe()) {
    throw Error(ErrorCode::kUsage, "compressed-tensors export: layer '" + name + "' trained on " + trained.describe() +
                ", and the export's scheme " + preset.name + " is " + expected.describe() +
                ": export the scheme it trained on (qat.weights.scheme), or merged");
  }
  const auto quantized = layer.convert();
  // The scales in the export's dtype when they are exact in it (bf16 weights' are), else fp32.
  const auto scale = quantized.params.scale.to(torch::kCPU);
  const bool exact = scale.to(dtype).to(torch::kFloat32).equal(scale);
  return qat::compressed_weight_from_codes(quantized, qat::parse_compression_format(preset.compression_format, "scheme"),
                                           exact ? dtype : torch::kFloat32);
}

// Sibling projections vLLM fuses into one matmul, whose NVFP4 weights llm-compressor gives one
// global scale (its fused weight observers).
const std::vector<std::vector<std::string>> kFusedProjections = {{"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}};

// For each layer of `weights` (name -> weight), the largest magnitude of it and its fused siblings.
std::map<std::string, torch::Tensor> fused_absmax(const std::map<std::string, torch::Tensor>& weights) {
  std::map<std::string, torch::Tensor> result;
  for (const auto& [layer, weight] : weights) result[layer] = weight.abs().max();
  for (const auto& [layer, weight] : weights) {
    const auto dot = layer.rfind('.');
    const std::string parent = dot == std::string::npos ? "" : layer.substr(0, dot + 1);
    const std::string own = layer.substr(parent.size());
    for (const auto& siblings : kFusedProjections) {
      if (std::find(siblings.begin(), siblings.end(), own) == siblings.end()) continue;
      for (const auto& sibling : siblings) {
        const auto other = weights.find(parent + sibling);
        if (other != weights.end()) result[layer] = torch::maximum(result[layer], other->second.abs().max());
      }
    }
  }
  return result;
}

void add_stored_tensors(const std::string& layer, const qat::CompressedWeight& weight,
                        std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  tensors.emplace_back(layer + "." + qat::CompressedLinear::data_name(weight.format), weight.data.to(torch::kCPU).contiguous());
  if (weight.format == qat::CompressionFormat::kPackQuantized) {
    tensors.emplace_back(layer + ".weight_shape", torch::tensor({weight.out_features, weight.in_features}, torch::kInt64));
  }
  tensors.emplace_back(layer + ".weight_scale", weight.scale.to(torch::kCPU).contiguous());
  if (weight.zero_point.defined()) tensors.emplace_back(layer + ".weight_zero_point", weight.zero_point.to(torch::kCPU).contiguous());
  if (weight.global_scale.defined()) {
    tensors.emplace_back(layer + ".weight_global_scale", weight.global_scale.to(torch::kCPU).contiguous());
  }
}

}  // namespace

std::vector<std::string> write_compressed_tensors_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base,
                                                        const std::string& out_dir,
                                                        const CompressedTensorsExportOptions& options) {
  if (options.preset == nullptr) throw Error(ErrorCode::kInternal, "compressed-tensors export without a scheme (internal error)");
  const auto& preset = *options.preset;
  const auto layers = linear_layers(model);
  std::map<std::string, std::shared_ptr<qat::QatLinear>> qat_layers;
  for (const auto& [name, layer] : qat::find_qat_layers(model)) qat_layers[name] = layer;

  std::vector<std::string> left_dense;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  auto merged = merged_weights(model, options.dtype);
  std::map<std::string, torch::Tensor> absmax;
  if (preset.two_level_scales) {
    std::map<std::string, torch::Tensor> dense_weights;
    for (const auto& [name, tensor] : merged) {
      const std::string layer = ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : "";
      if (layers.count(layer) && layer != kOutputHead) dense_weights[layer] = tensor;
    }
    absmax = fused_absmax(dense_weights);
  }
  for (auto& [name, tensor] : merged) {
    const std::string layer = ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : "";
    const auto found = layers.find(layer);
    if (layer.empty() || layer == kOutputHead || found == layers.end()) {
      tensors.emplace_back(name, std::move(tensor));
      continue;
    }
    const auto qat_layer = qat_layers.find(layer);
    if (qat_layer == qat_layers.end() && !preset_fits(preset, found->second->in_features())) {
      left_dense.push_back(layer);
      tensors.emplace_back(name, std::move(tensor));
      continue;
    }
    // PTQ rounds the weight as the file stores the model: in the export's dtype.
    const auto weight = qat_layer != qat_layers.end() ? trained_weight(layer, *qat_layer->second, preset, options.dtype)
                                                      : qat::compress_weight(preset, tensor, absmax[layer]);
    add_stored_tensors(layer, weight, tensors);
  }
  write_safetensors_checkpoint(out_dir, tensors, options.max_shard_bytes);
  // The layers left dense in module order, lm_head last, as the package lists them.
  auto ignore = left_dense;
  ignore.emplace_back(kOutputHead);
  auto config = nlohmann::ordered_json::parse(merged_config_json(base.config, options.dtype));
  config["quantization_config"] = nlohmann::ordered_json::parse(compressed_tensors_config_json(preset, ignore));
  write_file_atomically(out_dir + "/config.json", config.dump(2) + "\n");
  write_generation_config_and_tokenizer(base, out_dir);
  return left_dense;
}

bool is_compressed_tensors_checkpoint(const HfModelConfig& config) {
  return config.has_quantization_config && is_compressed_tensors_config(config.json);
}

namespace {

// A config group's weight arguments as qtrain's grid: the format stores it, or an Error.
qat::QuantSpec weight_spec(const CompressedTensorsArgs& args, qat::CompressionFormat format, const std::string& where) {
  qat::QuantSpec spec;
  spec.convention = qat::QuantConvention::kCompressedTensors;
  spec.bits = args.num_bits;
  spec.symmetric = args.symmetric;
  spec.group_size = args.group_size > 0 ? args.group_size : spec.group_size;
  const std::map<std::string, qat::Granularity> strategies = {{"tensor", qat::Granularity::kPerTensor},
                                                              {"channel", qat::Granularity::kPerChannel},
                                                              {"group", qat::Granularity::kPerGroup},
                                                              {"tensor_group", qat::Granularity::kPerGroup}};
  const auto strategy = strategies.find(args.strategy);
  if (strategy == strategies.end()) {
    throw Error(ErrorCode::kModelConfig, where + ".weights.strategy: '" + args.strategy +
                "' is not read (qtrain reads tensor, channel, group and NVFP4's tensor_group weights)");
  }
  spec.granularity = strategy->second;
  bool fits = false;
  switch (format) {
    case qat::CompressionFormat::kPackQuantized:
    case qat::CompressionFormat::kIntQuantized: fits = args.type == "int" && args.strategy != "tensor_group"; break;
    case qat::CompressionFormat::kFloatQuantized:
      fits = args.type == "float" && args.num_bits == 8 && args.symmetric && args.strategy != "tensor_group";
      break;
    case qat::CompressionFormat::kNvfp4PackQuantized:
      fits = args.type == "float" && args.num_bits == 4 && args.strategy == "tensor_group" && args.group_size == 16;
      break;
    case qat::CompressionFormat::kFp8Blocks: break;
  }
  if (!fits) {
    throw Error(ErrorCode::kModelConfig, where + ".weights: " + std::to_string(args.num_bits) + "-bit " + args.type + " " +
                args.strategy + " weights are not what format " + qat::compression_format_name(format) + " holds");
  }
  spec.format = args.type == "int" ? qat::QuantFormat::kInt
              : args.num_bits == 8 ? qat::QuantFormat::kFp8E4m3
                                   : qat::QuantFormat::kFp4E2m1;
  if (args.type == "int" && (args.num_bits < 2)) {
    throw Error(ErrorCode::kModelConfig, where + ".weights.num_bits: 1-bit weights are not read");
  }
  return spec;
}

// The dynamic per-token input quantization of a group, as a fake quantizer.
qat::FakeQuantizerOptions input_quantizer(const CompressedTensorsArgs& args, const std::string& where) {
  if (!args.dynamic || args.strategy != "token" || !args.symmetric || args.num_bits != 8) {
    throw Error(ErrorCode::kModelConfig, where + ".input_activations: " + std::to_string(args.num_bits) + "-bit " + args.type +
                " " + args.strategy + (args.dynamic ? " dynamic" : " static") +
                " activations are not read (qtrain runs dynamic symmetric per-token int8 and fp8 inputs)");
  }
  qat::FakeQuantizerOptions options;
  options.spec.convention = qat::QuantConvention::kCompressedTensors;
  options.spec.format = args.type == "int" ? qat::QuantFormat::kInt : qat::QuantFormat::kFp8E4m3;
  options.spec.bits = 8;
  options.spec.symmetric = true;
  options.spec.granularity = qat::Granularity::kPerToken;
  options.observer = qat::ObserverKind::kDynamic;
  return options;
}

// The stored tensors of projection `name`, checked against its shape and the group's grid.
qat::CompressedWeight read_compressed_weight(const SafetensorsCheckpoint& weights, const std::string& name,
                                             const qat::DenseLinearOptions& dense, const CompressedTensorsGroup& group,
                                             const std::string& where, std::set<std::string>& used) {
  qat::CompressedWeight weight;
  weight.format = qat::parse_compression_format(group.format, where + ".format");
  weight.spec = weight_spec(*group.weights, weight.format, where);
  weight.out_features = dense.out_features;
  weight.in_features = dense.in_features;
  const std::vector<int64_t> shape = {dense.out_features, dense.in_features};
  weight.spec.validate_for_shape(where + ".weights", shape);
  const int64_t groups = qat::params_shape(weight.spec, shape).back();
  const std::vector<int64_t> scale_shape =
      weight.spec.granularity == qat::Granularity::kPerTensor ? std::vector<int64_t>{1} : std::vector<int64_t>{dense.out_features, groups};
  auto take = [&](const std::string& suffix, c10::ScalarType dtype, const std::vector<int64_t>& expected) {
    const std::string tensor_name = name + "." + suffix;
    if (!weights.contains(tensor_name)) {
      throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + tensor_name + "' is missing (" + group.format +
                  " weights of " + weight.spec.describe() + " need it)");
    }
    auto tensor = weights.tensor(tensor_name);
    const bool scalar_scale = suffix == "weight_scale" && expected == std::vector<int64_t>{1} && tensor.numel() == 1;
    if (tensor.scalar_type() != dtype && dtype != c10::ScalarType::Undefined) {
      throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + tensor_name + "' is " +
                  std::string(c10::toString(tensor.scalar_type())) + ", " + group.format + " stores " + std::string(c10::toString(dtype)));
    }
    if (!scalar_scale && tensor.sizes() != c10::IntArrayRef(expected)) {
      throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + tensor_name + "' has shape " + shape_text(tensor.sizes()) +
                  ", a " + shape_text(shape) + " weight of " + weight.spec.describe() + " stores " + shape_text(expected));
    }
    used.insert(tensor_name);
    return scalar_scale ? tensor.reshape({1}) : tensor;
  };
  const auto any_float = c10::ScalarType::Undefined;
  switch (weight.format) {
    case qat::CompressionFormat::kPackQuantized: {
      const int64_t bits = weight.spec.bits;
      weight.data = take("weight_packed", torch::kInt32, {dense.out_features, (dense.in_features * bits + 31) / 32});
      if (weights.contains(name + ".weight_shape")) {
        const auto stored = weights.tensor(name + ".weight_shape").to(torch::kInt64);
        if (stored.numel() != 2 || stored[0].item<int64_t>() != dense.out_features || stored[1].item<int64_t>() != dense.in_features) {
          throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + name + ".weight_shape' says " +
                      shape_text(stored.sizes()) + " " + nlohmann::json(std::vector<int64_t>(stored.data_ptr<int64_t>(),
                      stored.data_ptr<int64_t>() + stored.numel())).dump() + ", config.json expects " + shape_text(shape));
        }
        used.insert(name + ".weight_shape");
      }
      weight.scale = take("weight_scale", any_float, scale_shape);
      if (!weight.spec.symmetric) weight.zero_point = take("weight_zero_point", torch::kInt32, {(dense.out_features * bits + 31) / 32, groups});
      break;
    }
    case qat::CompressionFormat::kIntQuantized:
      weight.data = take("weight", torch::kInt8, shape);
      weight.scale = take("weight_scale", any_float, scale_shape);
      if (!weight.spec.symmetric) weight.zero_point = take("weight_zero_point", torch::kInt8, scale_shape);
      break;
    case qat::CompressionFormat::kFloatQuantized:
      weight.data = take("weight", torch::kFloat8_e4m3fn, shape);
      weight.scale = take("weight_scale", any_float, scale_shape);
      break;
    case qat::CompressionFormat::kNvfp4PackQuantized:
      weight.data = take("weight_packed", torch::kUInt8, {dense.out_features, dense.in_features / 2});
      weight.scale = take("weight_scale", torch::kFloat8_e4m3fn, scale_shape);
      weight.global_scale = take("weight_global_scale", torch::kFloat32, {1});
      break;
    case qat::CompressionFormat::kFp8Blocks:
      throw Error(ErrorCode::kInternal, "fine-grained FP8 is not a compressed-tensors format (internal error)");
  }
  if (!weight.scale.is_floating_point()) {
    throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + name + ".weight_scale' is " +
                std::string(c10::toString(weight.scale.scalar_type())) + ", expected floating point scales");
  }
  return weight;
}

}  // namespace

LoadedModel load_compressed_tensors_llama(const std::string& model_dir, const HfModelConfig& config,
                                          const ModelLoadOptions& options) {
  const auto parsed = parse_compressed_tensors_config(config.json, config.path);
  const auto weights = SafetensorsCheckpoint::open(model_dir);
  const std::string where = config.path + ": quantization_config.config_groups.";
  return load_quantized_llama(
      model_dir, config, options, weights,
      [&](const std::string& name, const qat::DenseLinearOptions& dense,
          std::set<std::string>& used) -> std::shared_ptr<qat::LinearLayer> {
        const auto* group = find_compressed_tensors_group(parsed, name);
        if (group == nullptr || !group->weights) {
          if (weights.contains(name + ".weight_scale")) {
            throw Error(ErrorCode::kWeights, weights.source() + ": '" + name + ".weight_scale' is stored, but no config group of " +
                        config.path + " quantizes '" + name + "' (or ignore names it)");
          }
          return nullptr;
        }
        const auto at = where + group->name;
        auto stored = read_compressed_weight(weights, name, dense, *group, at, used);
        const auto bias = read_bias(weights, name, dense, model_dir, used);
        std::shared_ptr<qat::LinearLayer> layer = std::make_shared<qat::CompressedLinear>(std::move(stored), bias, options.dtype);
        if (group->input_activations) {
          layer = std::make_shared<qat::InputQuantizedLinear>(layer, input_quantizer(*group->input_activations, at),
                                                              at + ".input_activations");
        }
        return layer;
      });
}

}  // namespace qtrain::trainer
