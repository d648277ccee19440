#include "trainer/formats/gguf_export.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <optional>

#include "kernels/error.h"
#include "qat/gguf_block.h"
#include "qat/gguf_file_types.h"
#include "qat/gguf_grid.h"
#include "qat/qat_linear.h"
#include "trainer/formats/gguf_tokenizer.h"
#include "trainer/formats/merged_export.h"

namespace qtrain::trainer {

namespace {

constexpr uint32_t kQuantizationVersion = 2;  // GGML_QNT_VERSION

std::vector<uint8_t> tensor_bytes(const torch::Tensor& tensor) {
  const auto contiguous = tensor.contiguous();
  std::vector<uint8_t> bytes(contiguous.nbytes());
  std::memcpy(bytes.data(), contiguous.data_ptr(), bytes.size());
  return bytes;
}

// Rows of a q_proj / k_proj tensor (weight or bias) in llama.cpp's order.
torch::Tensor permute_rows(const torch::Tensor& tensor, int64_t heads) {
  return tensor.index_select(0, gguf_rope_row_order(tensor.size(0), heads).to(tensor.device()));
}

std::vector<std::pair<std::string, GgufValue>> model_metadata(const HfModelConfig& config,
                                                              const GgufArchitecture& architecture,
                                                              const std::string& name, uint32_t file_type) {
  const auto& llama = config.llama;
  const std::string key = std::string(architecture.name) + ".";
  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"general.architecture", std::string(architecture.name)},
      {"general.type", std::string("model")},
      {"general.name", name},
      {"general.alignment", kGgufDefaultAlignment},
      {key + "vocab_size", static_cast<uint32_t>(llama.vocab_size)},
      {key + "context_length", static_cast<uint32_t>(llama.max_position_embeddings)},
      {key + "embedding_length", static_cast<uint32_t>(llama.hidden_size)},
      {key + "block_count", static_cast<uint32_t>(llama.num_hidden_layers)},
      {key + "feed_forward_length", static_cast<uint32_t>(llama.intermediate_size)},
      {key + "rope.dimension_count", static_cast<uint32_t>(llama.rotary_dim())},  // partial rotary: the turned part
      {key + "attention.head_count", static_cast<uint32_t>(llama.num_attention_heads)},
      {key + "attention.head_count_kv", static_cast<uint32_t>(llama.num_key_value_heads)},
      {key + "attention.key_length", static_cast<uint32_t>(llama.head_dim)},
      {key + "attention.value_length", static_cast<uint32_t>(llama.head_dim)},
      {key + "attention.layer_norm_rms_epsilon", static_cast<float>(llama.rms_norm_eps)},
      {key + "rope.freq_base", static_cast<float>(llama.rope.theta)},
  };
  if (llama.rope.type == RopeType::kLinear) {
    metadata.emplace_back(key + "rope.scaling.type", std::string("linear"));
    metadata.emplace_back(key + "rope.scaling.factor", static_cast<float>(llama.rope.factor));
  } else if (llama.rope.type == RopeType::kYarn) {
    // llama.cpp reads YaRN's betas at its defaults (32 / 1) and rounds the ramp's ends as truncate does.
    metadata.emplace_back(key + "rope.scaling.type", std::string("yarn"));
    metadata.emplace_back(key + "rope.scaling.factor", static_cast<float>(llama.rope.factor));
    metadata.emplace_back(key + "rope.scaling.original_context_length", static_cast<uint32_t>(llama.rope.original_max_position_embeddings));
  } else if (llama.rope.type == RopeType::kLongRope && architecture.reads_rope_factors) {
    metadata.emplace_back(key + "rope.scaling.attn_factor", static_cast<float>(llama.rope.attention_factor));
    metadata.emplace_back(key + "rope.scaling.original_context_length",
                          static_cast<uint32_t>(llama.rope.original_max_position_embeddings));
  } else if (llama.rope.type != RopeType::kDefault) {
    throw Error(ErrorCode::kModelConfig, config.path + ": rope type '" + config.rope_type_name +
                "' is not supported by GGUF export of '" + architecture.name + "' yet (default and linear are; longrope on phi3)");
  }
  if (llama.feed_forward == FeedForwardKind::kExperts) {
    metadata.emplace_back(key + "expert_count", static_cast<uint32_t>(llama.experts.num_experts));
    metadata.emplace_back(key + "expert_used_count", static_cast<uint32_t>(llama.experts.experts_per_token));
  }
  if (architecture.add_metadata != nullptr) {
    GgufMetadata own;
    architecture.add_metadata(llama, key, own);
    for (auto& [name, value] : own) metadata.emplace_back(name, std::visit([](auto number) { return GgufValue(number); }, value));
  }
  metadata.emplace_back("general.file_type", file_type);
  metadata.emplace_back("general.quantization_version", kQuantizationVersion);
  return metadata;
}

}  // namespace

torch::Tensor gguf_rope_row_order(int64_t rows, int64_t heads) {
  if (heads <= 0 || rows % (2 * heads) != 0) {
    throw Error(ErrorCode::kModelConfig, "GGUF export: " + std::to_string(rows) + " rows do not split into " + std::to_string(heads) +
                " heads of an even size");
  }
  // convert_hf_to_gguf: w.reshape(heads, 2, rows / heads / 2, ...).swapaxes(1, 2).reshape(w.shape)
  return torch::arange(rows, torch::kInt64).view({heads, 2, rows / heads / 2}).transpose(1, 2).reshape({rows});
}

void require_gguf_exportable(const BaseDirectory& base) {
  const auto& config = base.config;
  model_metadata(config, gguf_architecture_for(config), "", qat::gguf_block_format(qat::GgufBlockType::kF32).file_type);  // its rope too
  gguf_tokenizer_metadata(base);
}

namespace {

// One tensor of the export before its type is chosen: its fp32 values in llama.cpp's row order,
// and the QAT layer's codes and scales where the run trained them (`codes` for int grids GGUF
// holds, `grid` for a GGUF block type's own).
struct ExportedTensor {
  std::string hf_name;
  std::string gguf_name;
  torch::Tensor values;
  std::optional<qat::QuantizedTensor> codes;
  std::optional<qat::GgufGridTensor> grid;
};

// The model's tensors with each expert bank as llama.cpp holds it: [experts, out, in], the fused
// gate_up_proj as two tensors (gate's rows, then up's, of every expert) under the names
// `mlp.experts.gate_proj.weight` / `up_proj` that gguf_tensor_name maps.
std::vector<std::pair<std::string, torch::Tensor>> expert_banks_apart(std::vector<std::pair<std::string, torch::Tensor>> tensors,
                                                                     const LlamaOptions& llama) {
  if (llama.feed_forward != FeedForwardKind::kExperts) return tensors;
  const auto ends_with = [](const std::string& name, const std::string& suffix) {
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const int64_t experts = llama.experts.num_experts;
  std::vector<std::pair<std::string, torch::Tensor>> apart;
  for (auto& [name, value] : tensors) {
    // Weights [experts, rows, in]; biases (gpt-oss) [experts, rows].
    for (const std::string part : {"weight", "bias"}) {
      const std::string gate_up = ".mlp.experts.gate_up_proj." + part, down = ".mlp.experts.down_proj." + part;
      if (ends_with(name, gate_up)) {
        const auto prefix = name.substr(0, name.size() - gate_up.size());
        const auto halves = value.dim() == 2 ? value.view({experts, 2, -1, value.size(1)}) : value.view({experts, 2, -1});
        apart.emplace_back(prefix + ".mlp.experts.gate_proj." + part, halves.select(1, 0).contiguous());
        apart.emplace_back(prefix + ".mlp.experts.up_proj." + part, halves.select(1, 1).contiguous());
        value = torch::Tensor();
      } else if (ends_with(name, down)) {
        apart.emplace_back(name, value.dim() == 2 ? value.view({experts, -1, value.size(1)}) : value.view({experts, -1}));
        value = torch::Tensor();
      }
    }
    if (value.defined()) apart.emplace_back(std::move(name), std::move(value));
  }
  return apart;
}

// The trained block type of a QAT tensor.
qat::GgufBlockType trained_type(const ExportedTensor& tensor, const std::string& weights_key) {
  return tensor.grid ? tensor.grid->type : qat::gguf_block_type_for(tensor.codes->spec, weights_key);
}

std::vector<ExportedTensor> exported_tensors(const LlamaForCausalLMImpl& model, const HfModelConfig& config,
                                             const GgufArchitecture& architecture) {
  const auto& llama = config.llama;
  std::map<std::string, std::shared_ptr<qat::QatLinear>> qat_layers;
  for (const auto& [name, layer] : qat::find_qat_layers(model)) qat_layers[name + ".weight"] = layer;
  auto heads_of = [&](const std::string& hf_name) -> int64_t {
    if (!architecture.rope_rows_reordered) return 0;
    if (hf_name.find(".self_attn.q_proj.") != std::string::npos) return llama.num_attention_heads;
    if (hf_name.find(".self_attn.k_proj.") != std::string::npos) return llama.num_key_value_heads;
    return 0;  // no permutation
  };
  std::vector<ExportedTensor> tensors;
  for (const auto& [merged_name, merged_value] : expert_banks_apart(merged_weights(model, torch::kFloat32), llama)) {
    const auto& hf_name = merged_name;
    const auto& value = merged_value;
    if (llama.tie_word_embeddings && hf_name == "lm_head.weight") continue;
    ExportedTensor tensor{hf_name, gguf_tensor_name(hf_name, architecture.name), value, std::nullopt, std::nullopt};
    const bool norm = hf_name.size() > 11 && hf_name.compare(hf_name.size() - 11, 11, "norm.weight") == 0;
    const int64_t heads = heads_of(hf_name);
    if (heads > 0) tensor.values = permute_rows(value, heads);
    if (architecture.norm_weights_plus_one && norm) tensor.values = tensor.values + 1.0;  // x (1 + w) as llama.cpp's x w
    const auto qat_layer = qat_layers.find(hf_name);
    if (value.dim() == 3 && qat_layer != qat_layers.end()) {
      throw Error(ErrorCode::kUsage, "GGUF export: " + hf_name + " is an expert bank trained with QAT, whose codes the GGUF "
                  "export does not write yet; export merged or safetensors-int, or leave the experts out of qat.target_modules");
    }
    if (qat_layer != qat_layers.end() && qat_layer->second->weight_fake_quant().spec().is_gguf_block()) {
      // Blocks run along the rows, each row its own: permuting the rows of every level is exact.
      auto grid = qat_layer->second->convert_gguf_grid();
      if (heads > 0) {
        for (auto* level : {&grid.codes, &grid.scales, &grid.mins, &grid.d, &grid.m, &grid.dmin}) {
          if (level->defined()) *level = permute_rows(*level, heads);
        }
      }
      tensor.grid = std::move(grid);
    } else if (qat_layer != qat_layers.end()) {
      auto quantized = qat_layer->second->convert();
      if (heads > 0) {
        // Whole rows move, and with them their blocks (which run along the row): codes and scales
        // are permuted alike, so the values stay exact.
        quantized.codes = permute_rows(quantized.codes, heads);
        quantized.params.scale = permute_rows(quantized.params.scale, heads);
        quantized.params.zero_point = permute_rows(quantized.params.zero_point, heads);
      }
      tensor.codes = std::move(quantized);
    }
    tensors.push_back(std::move(tensor));
  }
  if (llama.rope.type == RopeType::kLongRope) {
    for (const auto& [gguf_name, factors] : {std::pair{"rope_factors_long.weight", llama.rope.long_factor},
                                             std::pair{"rope_factors_short.weight", llama.rope.short_factor}}) {
      tensors.push_back({"", gguf_name, torch::tensor(factors, torch::kFloat64).to(torch::kFloat32), std::nullopt, std::nullopt});
    }
  }
  return tensors;
}

// What llama.cpp's type choice reads of the model's hyperparameters.
qat::GgufModelShape gguf_model_shape(const HfModelConfig& config, const GgufArchitecture& architecture) {
  qat::GgufModelShape shape;
  shape.architecture = architecture.name;
  shape.layers = config.llama.num_hidden_layers;
  shape.heads = config.llama.num_attention_heads;
  shape.kv_heads = config.llama.num_key_value_heads;
  if (config.llama.feed_forward == FeedForwardKind::kExperts) shape.experts = config.llama.experts.num_experts;
  return shape;
}

// The type of each tensor: with a file type, llama.cpp's quantizer's choice for it
// (qat/gguf_file_types.h); without one, a QAT layer's own block type and F32 for the rest.
std::vector<qat::GgufBlockType> chosen_types(const std::vector<ExportedTensor>& tensors, const HfModelConfig& config,
                                             const GgufArchitecture& architecture, const GgufExportOptions& options) {
  std::vector<qat::GgufBlockType> types;
  if (options.file_type == nullptr) {
    for (const auto& tensor : tensors) {
      types.push_back(tensor.codes || tensor.grid ? trained_type(tensor, options.weights_key) : qat::GgufBlockType::kF32);
    }
    return types;
  }
  std::vector<qat::GgufTensorShape> shapes;
  for (const auto& tensor : tensors) shapes.push_back({tensor.gguf_name, tensor.values.sizes().vec()});
  return qat::gguf_tensor_types(*options.file_type, gguf_model_shape(config, architecture), shapes);
}

// The bytes of `tensor` as `type`: a QAT layer's own codes when `type` is its block type, else
// llama.cpp's conversion or quantizer of the fp32 values (what llama-quantize does to an F32 file).
std::function<std::vector<uint8_t>()> tensor_data(const ExportedTensor& tensor, qat::GgufBlockType type,
                                                  const GgufExportOptions& options) {
  const std::string what = options.weights_key + " (" + tensor.hf_name + ")";
  if (tensor.codes || tensor.grid) {
    const auto trained = trained_type(tensor, options.weights_key);
    if (trained != type) {
      throw Error(ErrorCode::kUsage, what + ": trained on GGUF " + qat::gguf_block_format(trained).name + " blocks, but --gguf-type " +
                  options.file_type->name + " writes " + tensor.gguf_name + " as " + qat::gguf_block_format(type).name +
                  "; export with --gguf-type auto (the grid the run trained on), or train with that file type's grid");
    }
    if (tensor.grid) return [grid = *tensor.grid] { return qat::encode_gguf_grid(grid); };
    return [quantized = *tensor.codes, what] { return qat::encode_gguf_blocks(quantized, what); };
  }
  const auto values = tensor.values.contiguous();
  // ggml's fp32 -> fp16 / bf16 conversions round to nearest even, as torch's do.
  if (type == qat::GgufBlockType::kF32) return [values] { return tensor_bytes(values); };
  if (type == qat::GgufBlockType::kF16) return [values] { return tensor_bytes(values.to(torch::kFloat16)); };
  if (type == qat::GgufBlockType::kBF16) return [values] { return tensor_bytes(values.to(torch::kBFloat16)); };
  const auto& format = qat::gguf_block_format(type);
  if (values.numel() % format.block_elements != 0 || format.quantize == nullptr) {
    throw Error(ErrorCode::kInternal, tensor.gguf_name + " of shape " + shape_text(values.sizes()) + " cannot be " + format.name);
  }
  return [values, &format] {
    std::vector<uint8_t> bytes(static_cast<size_t>(values.numel() / format.block_elements * format.block_bytes));
    format.quantize(values.data_ptr<float>(), bytes.data(), values.numel());
    return bytes;
  };
}

}  // namespace

std::map<std::string, qat::GgufBlockType> gguf_layer_types(const torch::nn::Module& model, const HfModelConfig& config,
                                                           const qat::GgufFileType& file_type) {
  const auto& architecture = gguf_architecture_for(config);
  const auto wrapper = [](const qat::LinearLayer& layer) {
    return dynamic_cast<const qat::QatLinear*>(&layer) != nullptr || dynamic_cast<const qat::LoraLinear*>(&layer) != nullptr;
  };
  const auto layers = qat::find_linear_layers(model, [](const std::string&, const qat::LinearLayer&) { return true; }, wrapper);
  std::vector<qat::GgufTensorShape> shapes;
  for (const auto& layer : layers) {
    shapes.push_back({gguf_tensor_name(layer.name + ".weight", architecture.name), {layer.layer->out_features(), layer.layer->in_features()}});
  }
  const auto types = qat::gguf_tensor_types(file_type, gguf_model_shape(config, architecture), shapes);
  std::map<std::string, qat::GgufBlockType> by_layer;
  for (size_t index = 0; index < layers.size(); ++index) by_layer[layers[index].name] = types[index];
  return by_layer;
}

const qat::GgufFileType* parse_gguf_type(const std::string& name, const std::string& key) {
  if (name == qat::kGgufFileTypeAuto) return nullptr;
  return &qat::find_gguf_file_type(name, key);
}

void write_gguf_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_file,
                      const GgufExportOptions& options) {
  const auto& config = base.config;
  const auto& architecture = gguf_architecture_for(config);
  const auto exported = exported_tensors(model, config, architecture);
  const auto types = chosen_types(exported, config, architecture, options);
  std::vector<GgufTensorSource> tensors;
  for (size_t index = 0; index < exported.size(); ++index) {
    const auto& tensor = exported[index];
    tensors.push_back({tensor.gguf_name, tensor.values.sizes().vec(), types[index], tensor_data(tensor, types[index], options)});
  }
  const auto name = gguf_general_name(options.name.empty() ? base.name() : options.name, base);
  const uint32_t file_type = options.file_type ? options.file_type->llama_ftype : qat::gguf_file_type(types);
  auto metadata = model_metadata(config, architecture, name, file_type);
  for (auto& entry : gguf_tokenizer_metadata(base)) metadata.push_back(std::move(entry));
  write_gguf(out_file, metadata, tensors);
}

}  // namespace qtrain::trainer
