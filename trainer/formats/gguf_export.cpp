#include "trainer/formats/gguf_export.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "kernels/error.h"
#include "qat/gguf_block.h"
#include "qat/qat_linear.h"
#include "trainer/formats/merged_export.h"

namespace qtrain::trainer {

namespace {

// The pre-tokenizer regexes llama.cpp knows, by the name its tokenizer.ggml.pre gives them
// (llama-vocab.cpp): Llama 3's, Qwen2's and GPT-2's (ByteLevel's own regex).
struct PreTokenizerName {
  const char* regex;
  const char* gguf_pre;
};
const PreTokenizerName kPreTokenizers[] = {
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "llama-bpe"},
    // Qwen2 / Qwen2.5 / Qwen3: Llama 3's with single digits.
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "qwen2"},
};
constexpr const char* kGpt2ByteLevelPre = "gpt-2";

// gguf-py's TokenType.
enum TokenType : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };
constexpr uint32_t kQuantizationVersion = 2;  // GGML_QNT_VERSION

// tokenizer.ggml.pre for the pre_tokenizer of `base`'s tokenizer.json.
std::string pre_tokenizer_name(const BaseDirectory& base) {
  const std::string tokenizer_path = base.path + "/tokenizer.json";
  const auto document = nlohmann::json::parse(base.tokenizer_json(), nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded()) throw Error(ErrorCode::kTokenizer, tokenizer_path + ": not JSON");
  const auto model = document.value("model", nlohmann::json::object());
  if (model.value("byte_fallback", false)) {
    throw Error(ErrorCode::kTokenizer, tokenizer_path + ": a sentencepiece-style tokenizer (byte_fallback, Llama 2 / Mistral); GGUF export "
                "supports byte-level BPE tokenizers (Llama 3 style) only, for now");
  }
  nlohmann::json steps = nlohmann::json::array();
  const auto pre = document.value("pre_tokenizer", nlohmann::json());
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    steps = pre.value("pretokenizers", nlohmann::json::array());
  } else if (pre.is_object()) {
    steps.push_back(pre);
  }
  std::string regex;
  bool byte_level_regex = false;
  for (const auto& step : steps) {
    const auto type = step.value("type", "");
    if (type == "Split" && step.contains("pattern") && step["pattern"].contains("Regex")) {
      regex = step["pattern"]["Regex"].get<std::string>();
    } else if (type == "ByteLevel") {
      byte_level_regex = step.value("use_regex", true);
    }
  }
  for (const auto& known : kPreTokenizers) {
    if (regex == known.regex) return known.gguf_pre;
  }
  if (regex.empty() && byte_level_regex) return kGpt2ByteLevelPre;
  throw Error(ErrorCode::kTokenizer, tokenizer_path + ": pre_tokenizer " + pre.dump().substr(0, 200) +
              " is not one GGUF export knows (Llama 3's or Qwen2's regex, or GPT-2's byte-level); llama.cpp would tokenize "
              "differently");
}

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

std::vector<std::pair<std::string, GgufValue>> gguf_tokenizer_metadata(const BaseDirectory& base) {
  const auto& config = base.config;
  const std::string tokenizer_path = base.path + "/tokenizer.json";
  const auto pre = pre_tokenizer_name(base);
  const auto& tokenizer = base.tokenizer();
  const int64_t vocab_size = config.llama.vocab_size;
  if (tokenizer.vocab_size() > vocab_size) {
    throw Error(ErrorCode::kTokenizer, tokenizer_path + ": " + std::to_string(tokenizer.vocab_size()) + " tokens, more than config.json's "
                "vocab_size " + std::to_string(vocab_size));
  }
  // As convert_hf_to_gguf's get_vocab_base: ids the tokenizer lacks become unused [PADi] tokens.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int64_t id = 0; id < vocab_size; ++id) {
    const auto token = tokenizer.id_to_token(id);
    if (!token) {
      tokens.push_back("[PAD" + std::to_string(id) + "]");
      types.push_back(kUnused);
    } else {
      tokens.push_back(*token);
      types.push_back(tokenizer.is_special(id) ? kControl : tokenizer.is_added(id) ? kUserDefined : kNormal);
    }
  }
  std::vector<std::string> merges;
  for (const auto& [left, right] : tokenizer.merges()) merges.push_back(left + " " + right);

  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"tokenizer.ggml.model", std::string("gpt2")},
      {"tokenizer.ggml.pre", pre},
      {"tokenizer.ggml.tokens", GgufValue::strings(tokens)},
      {"tokenizer.ggml.token_type", GgufValue::int32s(types)},
      {"tokenizer.ggml.merges", GgufValue::strings(merges)},
  };
  const auto bos = tokenizer.bos_id() ? tokenizer.bos_id() : config.bos_token_id;
  const auto eos = tokenizer.eos_id()                ? tokenizer.eos_id()
                   : config.eos_token_ids.empty()    ? std::nullopt
                                                     : std::optional<int64_t>(config.eos_token_ids.front());
  const auto pad = tokenizer.pad_id() ? tokenizer.pad_id() : config.pad_token_id;
  if (bos) metadata.emplace_back("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*bos));
  if (eos) metadata.emplace_back("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(*eos));
  if (pad) metadata.emplace_back("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(*pad));
  // What the post-processor adds around a text, as transformers' add_special_tokens does.
  const auto framed = tokenizer.encode("", /*add_special_tokens=*/true);
  const bool add_bos = bos && !framed.empty() && framed.front() == *bos;
  const bool add_eos = eos && !framed.empty() && framed.back() == *eos && (framed.size() > 1 || !add_bos);
  metadata.emplace_back("tokenizer.ggml.add_bos_token", add_bos);
  metadata.emplace_back("tokenizer.ggml.add_eos_token", add_eos);
  if (const auto chat_template = base.chat_template()) metadata.emplace_back("tokenizer.chat_template", *chat_template);
  return metadata;
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
