#include "trainer/formats/gguf_export.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "kernels/error.h"
#include "qat/gguf_block.h"
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
  } else if (llama.rope.type == RopeType::kLongRope && architecture.reads_rope_factors) {
    metadata.emplace_back(key + "rope.scaling.attn_factor", static_cast<float>(llama.rope.attention_factor));
    metadata.emplace_back(key + "rope.scaling.original_context_length",
                          static_cast<uint32_t>(llama.rope.original_max_position_embeddings));
  } else if (llama.rope.type != RopeType::kDefault) {
    throw Error(ErrorCode::kModelConfig, config.path + ": rope type '" + config.rope_type_name +
                "' is not supported by GGUF export of '" + architecture.name + "' yet (default and linear are; longrope on phi3)");
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

void write_gguf_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_file,
                      const GgufExportOptions& options) {
  if (options.float_type != qat::GgufBlockType::kF32 && options.float_type != qat::GgufBlockType::kF16) {
    throw Error(ErrorCode::kInternal, "GGUF export: unquantized weights are written as F32 or F16");
  }
  const auto& config = base.config;
  const auto& architecture = gguf_architecture_for(config);
  const auto& llama = config.llama;
  std::map<std::string, std::shared_ptr<qat::QatLinear>> qat_layers;
  for (const auto& [name, layer] : qat::find_qat_layers(model)) qat_layers[name + ".weight"] = layer;

  auto heads_of = [&](const std::string& hf_name) -> int64_t {
    if (!architecture.rope_rows_reordered) return 0;
    if (hf_name.find(".self_attn.q_proj.") != std::string::npos) return llama.num_attention_heads;
    if (hf_name.find(".self_attn.k_proj.") != std::string::npos) return llama.num_key_value_heads;
    return 0;  // no permutation
  };

  std::vector<GgufTensorSource> tensors;
  for (const auto& [hf_name, value] : merged_weights(model, torch::kFloat32)) {
    if (llama.tie_word_embeddings && hf_name == "lm_head.weight") continue;
    GgufTensorSource tensor;
    tensor.name = gguf_tensor_name(hf_name, architecture.name);
    tensor.shape = value.sizes().vec();
    const bool norm = hf_name.size() > 11 && hf_name.compare(hf_name.size() - 11, 11, "norm.weight") == 0;
    const int64_t heads = heads_of(hf_name);
    const auto qat_layer = qat_layers.find(hf_name);
    if (qat_layer != qat_layers.end()) {
      auto quantized = qat_layer->second->convert();
      tensor.type = qat::gguf_block_type_for(quantized.spec, options.weights_key);
      if (heads > 0) {
        // Whole rows move, and with them their blocks (which run along the row): codes and scales
        // are permuted alike, so the values stay exact.
        quantized.codes = permute_rows(quantized.codes, heads);
        quantized.params.scale = permute_rows(quantized.params.scale, heads);
        quantized.params.zero_point = permute_rows(quantized.params.zero_point, heads);
      }
      const std::string what = options.weights_key + " (" + hf_name + ")";
      tensor.bytes = [quantized, what] { return qat::encode_gguf_blocks(quantized, what); };
    } else {
      auto rows = heads > 0 ? permute_rows(value, heads) : value;
      if (architecture.norm_weights_plus_one && norm) rows = rows + 1.0;  // x (1 + w) as llama.cpp's x w
      tensor.type = qat::GgufBlockType::kF32;
      if (value.dim() == 2) tensor.type = options.float_type;  // 1-D tensors (norms, biases) stay F32
      const bool half = tensor.type == qat::GgufBlockType::kF16;
      tensor.bytes = [rows, half] { return tensor_bytes(half ? rows.to(torch::kFloat16) : rows); };
    }
    tensors.push_back(std::move(tensor));
  }
  if (llama.rope.type == RopeType::kLongRope) {
    for (const auto& [gguf_name, factors] : {std::pair{"rope_factors_long.weight", llama.rope.long_factor},
                                             std::pair{"rope_factors_short.weight", llama.rope.short_factor}}) {
      GgufTensorSource tensor;
      tensor.name = gguf_name;
      const auto values = torch::tensor(factors, torch::kFloat64).to(torch::kFloat32);
      tensor.shape = values.sizes().vec();
      tensor.type = qat::GgufBlockType::kF32;
      tensor.bytes = [values] { return tensor_bytes(values); };
      tensors.push_back(std::move(tensor));
    }
  }

  std::vector<qat::GgufBlockType> types;
  for (const auto& tensor : tensors) types.push_back(tensor.type);
  const auto name = gguf_general_name(options.name.empty() ? base.name() : options.name, base);
  auto metadata = model_metadata(config, architecture, name, qat::gguf_file_type(types));
  for (auto& entry : gguf_tokenizer_metadata(base)) metadata.push_back(std::move(entry));
  write_gguf(out_file, metadata, tensors);
}

}  // namespace qtrain::trainer
