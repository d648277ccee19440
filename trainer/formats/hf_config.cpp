#include "trainer/formats/hf_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/error.h"
#include "trainer/model/model_families.h"

namespace qtrain::trainer {

using nlohmann::json;

c10::ScalarType parse_dtype_name(const std::string& name, const std::string& what, ErrorCode code) {
  if (name == "bf16" || name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return c10::ScalarType::Half;
  if (name == "fp32" || name == "float32" || name == "float") return c10::ScalarType::Float;
  throw Error(code, what + ": unknown dtype '" + name + "' (expected bf16, fp16 or fp32)");
}

std::string dtype_short_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Half: return "fp16";
    case c10::ScalarType::Float: return "fp32";
    default: return c10::toString(dtype);
  }
}

namespace {

// Reads config.json keys with messages that name the file and the key.
class ConfigReader {
 public:
  ConfigReader(const json& object, std::string path) : object_(object), path_(std::move(path)) {}

  bool has(const std::string& key) const { return object_.contains(key) && !object_.at(key).is_null(); }
  const json& value(const std::string& key) const { return object_.at(key); }

  int64_t positive_int(const std::string& key) const {
    if (!has(key)) fail("is missing the required key '" + key + "'");
    return positive_int_value(object_.at(key), key);
  }

  int64_t positive_int_or(const std::string& key, int64_t fallback) const {
    return has(key) ? positive_int_value(object_.at(key), key) : fallback;
  }

  double number_or(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    const auto& value = object_.at(key);
    if (!value.is_number()) fail("key '" + key + "' must be a number, got " + value.dump());
    return value.get<double>();
  }

  bool bool_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const auto& value = object_.at(key);
    if (!value.is_boolean()) fail("key '" + key + "' must be true or false, got " + value.dump());
    return value.get<bool>();
  }

  std::string string_or(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const auto& value = object_.at(key);
    if (!value.is_string()) fail("key '" + key + "' must be a string, got " + value.dump());
    return value.get<std::string>();
  }

  std::optional<int64_t> optional_id(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    const auto& value = object_.at(key);
    if (value.is_array() && !value.empty()) return id_value(value.at(0), key);
    return id_value(value, key);
  }

  std::vector<int64_t> id_list(const std::string& key) const {
    if (!has(key)) return {};
    const auto& value = object_.at(key);
    std::vector<int64_t> ids;
    if (value.is_array()) {
      for (const auto& element : value) ids.push_back(id_value(element, key));
    } else {
      ids.push_back(id_value(value, key));
    }
    return ids;
  }

  const json& object() const { return object_; }
  const std::string& path() const { return path_; }

  [[noreturn]] void fail(const std::string& what) const { throw Error(ErrorCode::kModelConfig, path_ + ": " + what); }

 private:
  int64_t positive_int_value(const json& value, const std::string& key) const {
    if (!value.is_number_integer() || value.get<int64_t>() <= 0) {
      fail("key '" + key + "' must be a positive integer, got " + value.dump());
    }
    return value.get<int64_t>();
  }

  int64_t id_value(const json& value, const std::string& key) const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0) {
      fail("key '" + key + "' must be a token id (a non-negative integer), got " + value.dump());
    }
    return value.get<int64_t>();
  }

  const json& object_;
  std::string path_;
};

// One rope settings object: `parameters` (named `parameters_key` in messages) with its theta
// falling back to `theta`.
RopeOptions read_rope_settings(const ConfigReader& config, const json& parameters, const std::string& parameters_key,
                               double theta, std::string& type_name) {
  RopeOptions rope;
  if (!parameters.is_object()) config.fail("key '" + parameters_key + "' must be an object, got " + parameters.dump());
  ConfigReader scaling(parameters, config.path() + " (" + parameters_key + ")");
  rope.theta = scaling.number_or("rope_theta", theta);
  type_name = scaling.string_or("rope_type", scaling.string_or("type", "default"));
  if (type_name == "default") {
    rope.type = RopeType::kDefault;
  } else if (type_name == "linear") {
    rope.type = RopeType::kLinear;
  } else if (type_name == "dynamic") {
    rope.type = RopeType::kDynamic;
  } else if (type_name == "llama3") {
    rope.type = RopeType::kLlama3;
  } else if (type_name == "longrope") {
    rope.type = RopeType::kLongRope;
  } else {
    config.fail("rope type '" + type_name + "' is not supported (supported: default, linear, dynamic, llama3, longrope)");
  }
  if (rope.type == RopeType::kLongRope) return rope;  // read_longrope reads the rest
  if (rope.type != RopeType::kDefault) {
    if (!scaling.has("factor")) config.fail("rope type '" + type_name + "' needs a 'factor' in " + parameters_key);
    rope.factor = scaling.number_or("factor", 1.0);
    if (rope.factor <= 0) config.fail("rope 'factor' must be positive, got " + std::to_string(rope.factor));
  }
  rope.low_freq_factor = scaling.number_or("low_freq_factor", 1.0);
  rope.high_freq_factor = scaling.number_or("high_freq_factor", 4.0);
  rope.original_max_position_embeddings = scaling.positive_int_or("original_max_position_embeddings", 0);
  if (rope.type == RopeType::kLlama3) {
    if (rope.original_max_position_embeddings == 0) {
      config.fail("rope type 'llama3' needs 'original_max_position_embeddings' in " + parameters_key);
    }
    if (rope.high_freq_factor <= rope.low_freq_factor) {
      config.fail("rope 'high_freq_factor' must be greater than 'low_freq_factor'");
    }
  }
  return rope;
}

std::vector<double> number_list(const ConfigReader& scaling, const std::string& key, size_t length) {
  if (!scaling.has(key) || !scaling.value(key).is_array()) scaling.fail("rope type 'longrope' needs the list '" + key + "'");
  std::vector<double> numbers;
  for (const auto& value : scaling.value(key)) {
    if (!value.is_number()) scaling.fail("'" + key + "' must list numbers, got " + value.dump());
    numbers.push_back(value.get<double>());
  }
  if (numbers.size() != length) {
    scaling.fail("'" + key + "' must list " + std::to_string(length) + " numbers (half the rotary dimensions), got " +
                 std::to_string(numbers.size()));
  }
  return numbers;
}

// Phi-3's longrope, as transformers' _compute_longrope_parameters reads it: the factors per
// rotary frequency, the pre-training context (in the rope parameters or, 4.x, beside them), and
// the cos / sin scale: attention_factor, or else sqrt(1 + ln(factor) / ln(original context)) with
// factor = max_position_embeddings / original context unless given.
void read_longrope(const ConfigReader& config, const json& parameters, const std::string& parameters_key,
                   LlamaOptions& llama) {
  ConfigReader scaling(parameters, config.path() + " (" + parameters_key + ")");
  auto& rope = llama.rope;
  const auto half = static_cast<size_t>(llama.rotary_dim() / 2);
  rope.short_factor = number_list(scaling, "short_factor", half);
  rope.long_factor = number_list(scaling, "long_factor", half);
  rope.original_max_position_embeddings =
      scaling.positive_int_or("original_max_position_embeddings", config.positive_int_or("original_max_position_embeddings", 0));
  if (rope.original_max_position_embeddings == 0) {
    config.fail("rope type 'longrope' needs 'original_max_position_embeddings' (the pre-training context)");
  }
  const double original = static_cast<double>(rope.original_max_position_embeddings);
  rope.factor = scaling.number_or("factor", static_cast<double>(llama.max_position_embeddings) / original);
  rope.attention_factor = scaling.number_or(
      "attention_factor", rope.factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(rope.factor) / std::log(original)));
}

// The rope of every layer, and of the sliding layers where they have their own.
// transformers 5.x writes `rope_parameters` {rope_theta, rope_type, ...}, per layer type
// ({full_attention: {...}, sliding_attention: {...}}) for Gemma 3; 4.x writes `rope_theta` beside
// an optional `rope_scaling` {type | rope_type, factor, ...}, and Gemma 3's sliding layers' theta
// as `rope_local_base_freq`.
void read_rope(const ConfigReader& config, const ModelFamily& family, LlamaOptions& llama, std::string& type_name) {
  json parameters = json::object();
  std::string parameters_key = "rope_parameters";
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (config.has(key)) {
      parameters = config.object().at(key);
      parameters_key = key;
      break;
    }
  }
  if (!family.rope_per_layer_type) {
    json settings = parameters;
    if (family.phi3_block && settings.is_object()) {
      // transformers' Phi3Config reads these older names of longrope as longrope.
      for (const char* key : {"rope_type", "type"}) {
        if (settings.contains(key) && (settings[key] == "su" || settings[key] == "yarn")) settings[key] = "longrope";
      }
    }
    // 5.x keeps partial_rotary_factor in rope_parameters, 4.x beside it.
    llama.partial_rotary_factor = ConfigReader(settings.is_object() ? settings : json::object(), config.path())
                                      .number_or("partial_rotary_factor", config.number_or("partial_rotary_factor", 1.0));
    if (llama.partial_rotary_factor <= 0 || llama.partial_rotary_factor > 1 || llama.rotary_dim() % 2 != 0) {
      config.fail("partial_rotary_factor " + std::to_string(llama.partial_rotary_factor) +
                  " must be in (0, 1] and turn an even number of each head's " + std::to_string(llama.head_dim) + " dimensions");
    }
    llama.rope = read_rope_settings(config, settings, parameters_key, config.number_or("rope_theta", 10000.0), type_name);
    if (llama.rope.type == RopeType::kLongRope) read_longrope(config, settings, parameters_key, llama);
    return;
  }
  // transformers' defaults for Gemma 3: theta 1M on full layers (and rope_scaling there), 10k on sliding ones.
  const bool per_type = parameters.is_object() && parameters.contains("full_attention");
  std::string sliding_type;
  llama.rope = read_rope_settings(config, per_type ? parameters.at("full_attention") : parameters,
                                  per_type ? parameters_key + ".full_attention" : parameters_key,
                                  config.number_or("rope_theta", 1000000.0), type_name);
  llama.sliding_rope = read_rope_settings(
      config, per_type && parameters.contains("sliding_attention") ? parameters.at("sliding_attention") : json::object(),
      parameters_key + ".sliding_attention", config.number_or("rope_local_base_freq", 10000.0), sliding_type);
  if (llama.rope.type == RopeType::kLongRope || llama.sliding_rope->type == RopeType::kLongRope) {
    config.fail("rope type 'longrope' per layer type is not supported (Phi-3's longrope is)");
  }
}

// The layers that slide and over how many keys, as the family spells them (see
// SlidingWindowKeys). A layer type qtrain does not know is an error, never full attention.
void read_sliding_window(const ConfigReader& reader, const ModelFamily& family, LlamaOptions& llama) {
  const auto layers = static_cast<size_t>(llama.num_hidden_layers);
  switch (family.sliding_window) {
    case SlidingWindowKeys::kNone: return;
    case SlidingWindowKeys::kEveryLayer:
      if (!reader.has("sliding_window")) return;
      llama.sliding_window = reader.positive_int("sliding_window");
      llama.sliding_layers.assign(layers, true);
      return;
    case SlidingWindowKeys::kLayerTypes:
    case SlidingWindowKeys::kLayerTypesOrPattern: break;
  }
  std::vector<bool> sliding(layers, false);
  if (reader.has("layer_types")) {
    const auto& types = reader.value("layer_types");
    if (!types.is_array() || types.size() != layers) {
      reader.fail("key 'layer_types' must list one of \"full_attention\" / \"sliding_attention\" for each of the " +
                  std::to_string(layers) + " layers, got " + types.dump());
    }
    for (size_t layer = 0; layer < layers; ++layer) {
      const auto& type = types.at(layer);
      if (type == "sliding_attention") {
        sliding[layer] = true;
      } else if (type != "full_attention") {
        reader.fail("key 'layer_types' entry " + std::to_string(layer) + " is " + type.dump() +
                    "; qtrain implements \"full_attention\" and \"sliding_attention\"");
      }
    }
  } else if (family.sliding_window == SlidingWindowKeys::kLayerTypesOrPattern) {
    // As transformers fills layer_types in: every pattern-th layer (1-based) attends fully.
    const int64_t pattern = reader.positive_int_or(
        "sliding_window_pattern", reader.positive_int_or("_sliding_window_pattern", family.sliding_pattern));
    for (size_t layer = 0; layer < layers; ++layer) sliding[layer] = (static_cast<int64_t>(layer) + 1) % pattern != 0;
  } else if (reader.bool_or("use_sliding_window", false)) {
    const int64_t first = reader.positive_int_or("max_window_layers", 0);
    for (size_t layer = 0; layer < layers; ++layer) sliding[layer] = static_cast<int64_t>(layer) >= first;
  }
  if (std::find(sliding.begin(), sliding.end(), true) == sliding.end()) return;
  if (!reader.has("sliding_window")) {
    reader.fail("has sliding-attention layers but no 'sliding_window' (how many keys they see)");
  }
  llama.sliding_window = reader.positive_int("sliding_window");
  llama.sliding_layers = std::move(sliding);
}

// Phi-3's block: fused projections, and dropout keys that must be off (qtrain trains without them).
void read_phi3_block(const ConfigReader& reader, LlamaOptions& llama) {
  llama.fused_projections = true;
  for (const char* key : {"embd_pdrop", "resid_pdrop", "attention_dropout"}) {
    if (reader.number_or(key, 0.0) != 0.0) {
      reader.fail(std::string("key '") + key + "' is " + reader.value(key).dump() +
                  "; qtrain implements Phi-3 without dropout in the model (set it to 0.0; LoRA has its own lora.dropout)");
    }
  }
}

// Gemma's block switches. The soft-caps have family defaults in transformers (Gemma 2: 50 and 30,
// Gemma 3: none), so a config must say them: absent is an error, null is none.
void read_gemma_block(const ConfigReader& reader, LlamaOptions& llama) {
  llama.norm_style = NormStyle::kGemma;
  llama.sandwich_norms = true;
  llama.scale_embeddings = true;
  llama.query_pre_attn_scalar = reader.number_or("query_pre_attn_scalar", 256.0);
  if (llama.query_pre_attn_scalar <= 0) reader.fail("key 'query_pre_attn_scalar' must be positive");
  const auto softcap = [&](const std::string& key) {
    if (!reader.object().contains(key)) {
      reader.fail("is missing the key '" + key + "' (Gemma 2 caps at 50 / 30 and Gemma 3 not at all: write the number, or null for none)");
    }
    const double cap = reader.number_or(key, 0.0);
    if (cap < 0) reader.fail("key '" + key + "' must be positive or null, got " + std::to_string(cap));
    return cap;
  };
  llama.attention_softcap = softcap("attn_logit_softcapping");
  llama.final_logit_softcap = softcap("final_logit_softcapping");
  if (reader.bool_or("use_bidirectional_attention", false)) {
    reader.fail("use_bidirectional_attention is true (an encoder-style Gemma); qtrain trains causal decoders only");
  }
}

}  // namespace

HfModelConfig read_hf_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream file(path);
  if (!file) {
    throw Error(ErrorCode::kModelConfig,
                path + ": cannot open (expected a Hugging Face model directory with config.json)");
  }
  std::stringstream text;
  text << file.rdbuf();
  return parse_hf_config(text.str(), path);
}

HfModelConfig parse_hf_config(const std::string& text, const std::string& path) {
  HfModelConfig config;
  config.path = path;
  config.json = text;
  json object = json::parse(config.json, nullptr, /*allow_exceptions=*/false);
  if (object.is_discarded()) throw Error(ErrorCode::kModelConfig, config.path + ": not valid JSON");
  if (!object.is_object()) throw Error(ErrorCode::kModelConfig, config.path + ": expected a JSON object");
  ConfigReader reader(object, config.path);

  std::string architecture;
  if (reader.has("architectures")) {
    const auto& architectures = object.at("architectures");
    if (!architectures.is_array() || architectures.empty() || !architectures.at(0).is_string()) {
      reader.fail("key 'architectures' must be a list of names, got " + architectures.dump());
    }
    architecture = architectures.at(0).get<std::string>();
  }
  const std::string model_type = reader.string_or("model_type", "");
  const ModelFamily* family = find_model_family(architecture, model_type);
  if (family == nullptr) {
    reader.fail("unsupported architecture '" + (architecture.empty() ? model_type : architecture) +
                "' (qtrain supports " + supported_architectures() + ")");
  }
  config.architecture = family->architecture;
  config.family = family;
  auto& llama = config.llama;
  // Gemma names the MLP's activation hidden_activation (its hidden_act, where present, is ignored).
  const std::string activation_key = family->gemma_block && reader.has("hidden_activation") ? "hidden_activation" : "hidden_act";
  const std::string activation = reader.string_or(activation_key, "silu");
  if (activation == "silu") {
    llama.activation = Activation::kSilu;
  } else if (activation == "gelu_pytorch_tanh") {
    llama.activation = Activation::kGeluTanh;
  } else {
    reader.fail(activation_key + " '" + activation + "' is not supported (supported: silu, gelu_pytorch_tanh)");
  }
  llama.vocab_size = reader.positive_int("vocab_size");
  llama.hidden_size = reader.positive_int("hidden_size");
  llama.intermediate_size = reader.positive_int("intermediate_size");
  llama.num_hidden_layers = reader.positive_int("num_hidden_layers");
  llama.num_attention_heads = reader.positive_int("num_attention_heads");
  llama.num_key_value_heads = reader.positive_int_or("num_key_value_heads", llama.num_attention_heads);
  if (llama.num_attention_heads % llama.num_key_value_heads != 0) {
    reader.fail("num_attention_heads (" + std::to_string(llama.num_attention_heads) +
                ") must be a multiple of num_key_value_heads (" + std::to_string(llama.num_key_value_heads) + ")");
  }
  if (!reader.has("head_dim") && llama.hidden_size % llama.num_attention_heads != 0) {
    reader.fail("hidden_size must be a multiple of num_attention_heads when head_dim is not given");
  }
  llama.head_dim = reader.positive_int_or("head_dim", llama.hidden_size / llama.num_attention_heads);
  if (llama.head_dim % 2 != 0) reader.fail("head_dim must be even for rotary embeddings");
  llama.max_position_embeddings = reader.positive_int_or("max_position_embeddings", 2048);
  llama.rms_norm_eps = reader.number_or("rms_norm_eps", 1e-6);
  switch (family->attention_bias) {
    case AttentionBias::kFromConfig:
      llama.attention_bias = llama.output_bias = reader.bool_or("attention_bias", false);
      break;
    case AttentionBias::kNone: break;
    case AttentionBias::kQueryKeyValueOnly: llama.attention_bias = true; break;
  }
  llama.mlp_bias = reader.bool_or("mlp_bias", false);
  llama.tie_word_embeddings = reader.bool_or("tie_word_embeddings", false);
  read_rope(reader, *family, llama, config.rope_type_name);
  llama.query_key_norm = family->query_key_norm;
  read_sliding_window(reader, *family, llama);
  if (family->gemma_block) read_gemma_block(reader, llama);
  if (family->phi3_block) read_phi3_block(reader, llama);

  const std::string dtype_key = reader.has("dtype") ? "dtype" : "torch_dtype";
  config.stored_dtype = parse_dtype_name(reader.string_or(dtype_key, "float32"), config.path + ": key '" + dtype_key + "'",
                                        ErrorCode::kModelConfig);
  config.bos_token_id = reader.optional_id("bos_token_id");
  config.eos_token_ids = reader.id_list("eos_token_id");
  config.pad_token_id = reader.optional_id("pad_token_id");
  config.has_quantization_config = reader.has("quantization_config");
  return config;
}

nlohmann::json quantization_config_json(const HfModelConfig& config) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(config.json);
  } catch (const nlohmann::json::exception& error) {
    throw Error(ErrorCode::kModelConfig, config.path + ": not valid JSON (" + error.what() + ")");
  }
  if (!object.contains("quantization_config") || !object.at("quantization_config").is_object()) return nullptr;
  return object.at("quantization_config");
}

}  // namespace qtrain::trainer
