#pragma once
// The decoder families qtrain loads, one row each (trainer/model/families/NAME.cpp): how
// config.json names them, what each reads from it and changes in the Llama decoder
// (trainer/model/llama.h builds them all), how llama.cpp runs it, its chat templates and the bench
// shapes of its published models. Adding a family is one file there and its line in families.h's
// list there, and, where it needs new math, a switch in LlamaOptions.
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "trainer/model/llama_options.h"

namespace qtrain::trainer {

class HfConfigReader;  // trainer/model/config_reader.h

// Which projections of the attention carry a bias.
enum class AttentionBias {
  kFromConfig,        // config.json's attention_bias, on q, k, v and o (Llama, Qwen3)
  kNone,              // never (Mistral)
  kQueryKeyValueOnly  // q, k and v always, o never (Qwen2)
};

// Where a family's sliding-window attention is set in config.json.
enum class SlidingWindowKeys {
  kNone,        // no sliding window (Llama)
  kEveryLayer,  // sliding_window (null: none) applies to every layer (Mistral)
  kLayerTypes,  // layer_types ("sliding_attention" / "full_attention"), or else use_sliding_window
                // with max_window_layers: layers from that index on slide (Qwen2, Qwen3)
  kLayerTypesOrPattern  // layer_types, or else every layer slides but each sliding_window_pattern-th
                        // (ModelFamily::sliding_pattern by default) (Gemma 2, Gemma 3)
};

// An architecture's own GGUF keys ("gemma2.attn_logit_softcapping"), each a u32 or an f32 as
// llama.cpp reads it; the exporter (trainer/formats/gguf_export.cpp) writes them as GGUF values.
using GgufMetadata = std::vector<std::pair<std::string, std::variant<uint32_t, float>>>;

// llama.cpp's loader treats a general.name that mentions some families specially, whatever the
// file's architecture: it looks up `tokens`, and a vocabulary without one of them fails to load.
// Such a name is written with `replacement` for each of `spellings`.
struct GgufNameRule {
  std::vector<std::string> spellings;  // lower case, found in the lower-cased name
  std::vector<std::string> tokens;
  std::string replacement;
};

// What llama.cpp reads for a family (llama-model.cpp's load_hparams / load_tensors, its rope type
// per architecture, and gguf-py's tensor_mapping.py).
struct GgufArchitecture {
  std::string name;  // general.architecture, and the prefix of the model's keys
  // llama.cpp's "norm" rope rotates adjacent pairs, so convert_hf_to_gguf reorders q / k rows
  // (Llama); its "neox" rope rotates halves as transformers does, and the rows stay (Qwen).
  bool rope_rows_reordered = false;
  bool reads_attention_bias = false;  // attn_q / k / v bias (and attn_output's, for llama)
  bool reads_query_key_norm = false;  // attn_q_norm / attn_k_norm
  // Phi-3's longrope: rope_factors_long / _short tensors and rope.scaling.attn_factor; llama.cpp
  // takes the long factors when its context (not, as transformers, the sequence) passes
  // rope.scaling.original_context_length.
  bool reads_rope_factors = false;
  // A sliding window and its layer pattern (add_metadata writes them); elsewhere llama.cpp attends
  // over every earlier key, and a window shorter than the context is refused.
  bool reads_sliding_window = false;
  // Norm weights stored as 1 + w: the model's RMSNorm is x (1 + w) (NormStyle::kUnitOffset), llama.cpp's
  // x w, and convert_hf_to_gguf adds the 1.
  bool norm_weights_plus_one = false;
  // Names inside model.layers.N. that llama.cpp spells its own way for this architecture, looked up
  // before the names every architecture shares: {Hugging Face prefix, GGUF prefix}.
  std::vector<std::pair<std::string, std::string>> layer_tensor_names;
  // Appends the architecture's own keys ("ARCH." is `prefix`) for a model of `llama`.
  void (*add_metadata)(const LlamaOptions& llama, const std::string& prefix, GgufMetadata& metadata) = nullptr;
  // What llama.cpp fixes where transformers reads config.json, as "a ... (why)" for a message, or ""
  // when `llama` agrees with it.
  std::string (*llama_cpp_difference)(const LlamaOptions& llama) = nullptr;
  GgufNameRule general_name_rule;
};

// A published model's shape, for benchmarks and estimates that need it without its weights:
// `config_json` is its config.json (the keys that shape the work), read by parse_hf_config as a
// checkpoint's would be.
struct BenchShape {
  std::string name;  // qtrain bench --model NAME
  std::string config_json;
};

// How a mixture-of-experts family's published checkpoints name each expert's tensors, one module
// per expert: model.layers.N.BLOCK.experts.E.GATE.weight (transformers 4's layout, which vLLM,
// llama.cpp's converter and transformers 5, fusing them as it loads, all read). qtrain reads these
// and transformers 5's fused [experts, ...] tensors, and exports these.
struct ExpertTensorNames {
  std::string block = "mlp";  // the block's module (its router is BLOCK.gate)
  std::string gate = "gate_proj", up = "up_proj", down = "down_proj";
  // A family whose experts transformers holds interleaved (ExpertOptions::interleaved_gate_up:
  // gpt-oss) publishes them fused instead, as transformers holds them (trainer/formats/expert_checkpoint.h).
};

struct ModelFamily {
  // What every row names: config.json's architectures[0] and model_type, and llama.cpp's
  // architecture (GgufArchitecture::name); the rest starts at the Llama decoder's defaults.
  ModelFamily(std::string architecture, std::string model_type, std::string gguf_name);

  // Appends the bench shape `name` whose config.json holds this row's architectures and model_type,
  // then `keys` (its other keys, as JSON members).
  void add_bench_shape(const std::string& name, const std::string& keys);

  std::string architecture;  // config.json's architectures[0]
  std::string model_type;    // config.json's model_type
  // The decoder's switches (llama_options.h).
  AttentionBias attention_bias = AttentionBias::kFromConfig;
  bool query_key_norm = false;  // RMSNorm on each head's q and k before rope (Qwen3, Gemma 3)
  SlidingWindowKeys sliding_window = SlidingWindowKeys::kNone;
  int64_t sliding_pattern = 0;  // kLayerTypesOrPattern's default
  // rope_parameters.{sliding,full}_attention (5.x), or rope_theta / rope_scaling for the full layers
  // and rope_local_base_freq for the sliding ones (4.x).
  bool rope_per_layer_type = false;
  double rope_theta = 10000.0;  // transformers' default when config.json has none
  // The released checkpoints' activations pass fp16's 65,504: training in fp16 is refused.
  bool fp16_overflows = false;
  // config.json: the MLP activation's key where present (else hidden_act), older names of rope
  // types read as the name qtrain knows ({written, read as}), and the family's own keys and
  // refusals, read after the shape, rope and sliding window (nullptr: none).
  std::string activation_key = "hidden_act";
  std::vector<std::pair<std::string, std::string>> rope_type_aliases;
  void (*read_config)(const HfConfigReader& config, LlamaOptions& llama) = nullptr;
  ExpertTensorNames expert_names;  // FeedForwardKind::kExperts only
  GgufArchitecture gguf;
  std::vector<std::string> chat_templates;  // data/chat_template.h's families its checkpoints use
  std::vector<BenchShape> bench_shapes;
};

// Every family's row, in trainer/model/families/families.h's order.
const std::vector<ModelFamily>& model_families();

// The row for `architecture` (or, when that is empty, `model_type`); nullptr when none matches.
const ModelFamily* find_model_family(const std::string& architecture, const std::string& model_type);

// "LlamaForCausalLM, MistralForCausalLM, ...", for messages.
std::string supported_architectures();

}  // namespace qtrain::trainer
