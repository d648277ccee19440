#include "trainer/formats/hf_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/error.h"
#include "trainer/model/config_reader.h"
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

// One rope settings object: `parameters` (named `parameters_key` in messages) with its theta
// falling back to `theta`.
RopeOptions read_rope_settings(const HfConfigReader& config, const json& parameters, const std::string& parameters_key,
                               double theta, std::string& type_name) {
  RopeOptions rope;
  if (!parameters.is_object()) config.fail("key '" + parameters_key + "' must be an object, got " + parameters.dump());
  HfConfigReader scaling(parameters, config.path() + " (" + parameters_key + ")");
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
  } else if (type_name == "yarn") {
    rope.type = RopeType::kYarn;
  } else {
    config.fail("rope type '" + type_name + "' is not supported (supported: default, linear, dynamic, llama3, longrope, yarn)");
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
  if (rope.type == RopeType::kYarn) {
    // As transformers' _compute_yarn_parameters.
    if (rope.original_max_position_embeddings == 0) {
      config.fail("rope type 'yarn' needs 'original_max_position_embeddings' in " + parameters_key);
    }
    rope.beta_fast = scaling.number_or("beta_fast", 32.0);
    rope.beta_slow = scaling.number_or("beta_slow", 1.0);
    rope.truncate = scaling.bool_or("truncate", true);
    const auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    const double m = scaling.number_or("mscale", 0), m_all = scaling.number_or("mscale_all_dim", 0);
    rope.attention_factor = scaling.number_or(
        "attention_factor", m != 0 && m_all != 0 ? mscale(rope.factor, m) / mscale(rope.factor, m_all) : mscale(rope.factor, 1));
  }
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

std::vector<double> number_list(const HfConfigReader& scaling, const std::string& key, size_t length) {
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
void read_longrope(const HfConfigReader& config, const json& parameters, const std::string& parameters_key,
                   LlamaOptions& llama) {
  HfConfigReader scaling(parameters, config.path() + " (" + parameters_key + ")");
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
void read_rope(const HfConfigReader& config, const ModelFamily& family, LlamaOptions& llama, std::string& type_name) {
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
    if (settings.is_object()) {  // the family's older names of rope types, as the name qtrain reads
      for (const char* key : {"rope_type", "type"}) {
        for (const auto& [written, read_as] : family.rope_type_aliases) {
          if (settings.contains(key) && settings[key] == written) settings[key] = read_as;
        }
      }
    }
    // 5.x keeps partial_rotary_factor in rope_parameters, 4.x beside it.
    llama.partial_rotary_factor = HfConfigReader(settings.is_object() ? settings : json::object(), config.path())
                                      .number_or("partial_rotary_factor", config.number_or("partial_rotary_factor", 1.0));
    if (llama.partial_rotary_factor <= 0 || llama.partial_rotary_factor > 1 || llama.rotary_dim() % 2 != 0) {
      config.fail("partial_rotary_factor " + std::to_string(llama.partial_rotary_factor) +
                  " must be in (0, 1] and turn an even number of each head's " + std::to_string(llama.head_dim) + " dimensions");
    }
    llama.rope = read_rope_settings(config, settings, parameters_key, config.number_or("rope_theta", family.rope_theta), type_name);
    if (llama.rope.type == RopeType::kLongRope) read_longrope(config, settings, parameters_key, llama);
    return;
  }
  // The full layers' theta defaults to the family's, the sliding layers' to 10k (transformers' Gemma 3).
  const bool per_type = parameters.is_object() && parameters.contains("full_attention");
  std::string sliding_type;
  llama.rope = read_rope_settings(config, per_type ? parameters.at("full_attention") : parameters,
                                  per_type ? parameters_key + ".full_attention" : parameters_key,
                                  config.number_or("rope_theta", family.rope_theta), type_name);
  llama.sliding_rope = read_rope_settings(
      config, per_type && parameters.contains("sliding_attention") ? parameters.at("sliding_attention") : json::object(),
      parameters_key + ".sliding_attention", config.number_or("rope_local_base_freq", 10000.0), sliding_type);
  if (llama.rope.type == RopeType::kLongRope || llama.sliding_rope->type == RopeType::kLongRope) {
    config.fail("rope type 'longrope' per layer type is not supported (Phi-3's longrope is)");
  }
}

// The layers that slide and over how many keys, as the family spells them (see
// SlidingWindowKeys). A layer type qtrain does not know is an error, never full attention.
void read_sliding_window(const HfConfigReader& reader, const ModelFamily& family, LlamaOptions& llama) {
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
  HfConfigReader reader(object, config.path);

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
  const std::string activation_key = reader.has(family->activation_key) ? family->activation_key : "hidden_act";
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
  if (family->read_config != nullptr) family->read_config(reader, llama);

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
