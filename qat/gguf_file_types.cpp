#include "qat/gguf_file_types.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <utility>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

using T = GgufBlockType;

// ---- The mixes: llama_tensor_get_type_impl's branches for one ftype each ----------------------

// use_more_bits: the first and last eighth of the tensors, and every third one between.
bool uses_more_bits(const GgufTensorPlace& place) {
  const int64_t eighth = place.count / 8;
  return place.index < eighth || place.index >= 7 * place.count / 8 || (place.index - eighth) % 3 == 2;
}

// Q4_K_M and Q5_K_M: attn_v and ffn_down Q6_K where use_more_bits says so.
T q6_k_where_more_bits(T base, const GgufTensorPlace& place) { return uses_more_bits(place) ? T::kQ6_K : base; }

// Q2_K: attn_v Q4_K with 4 or more query heads per kv head, else Q3_K; ffn_down and attn_output
// Q3_K (attn_output Q5_K in an 8-expert model).
T q2_k_attention_v(T, const GgufTensorPlace& place) { return place.query_groups >= 4 ? T::kQ4_K : T::kQ3_K; }
T q2_k_ffn_down(T, const GgufTensorPlace&) { return T::kQ3_K; }
T q2_k_attention_output(T, const GgufTensorPlace& place) { return place.experts == 8 ? T::kQ5_K : T::kQ3_K; }

// Q3_K_S, Q4_K_S, Q4_K_M: attn_output Q5_K in an 8-expert model only.
T q5_k_with_eight_experts(T base, const GgufTensorPlace& place) { return place.experts == 8 ? T::kQ5_K : base; }

// Q3_K_M: the first two attn_v Q5_K and the rest Q4_K; ffn_down Q5_K in the first sixteenth of the
// layers and Q4_K after (llama.cpp keeps Q3_K on some of falcon's only); attn_output Q4_K.
T q3_k_m_attention_v(T, const GgufTensorPlace& place) { return place.index < 2 ? T::kQ5_K : T::kQ4_K; }
T q3_k_m_ffn_down(T, const GgufTensorPlace& place) { return place.index < place.count / 16 ? T::kQ5_K : T::kQ4_K; }
T q3_k_m_attention_output(T, const GgufTensorPlace& place) { return place.experts == 8 ? T::kQ5_K : T::kQ4_K; }

// Q3_K_L: attn_v, ffn_down and attn_output Q5_K (attn_output stays Q3_K in an 8-expert model: its
// list of mixes that bump it leaves Q3_K_L out).
T always_q5_k(T, const GgufTensorPlace&) { return T::kQ5_K; }
T q3_k_l_attention_output(T base, const GgufTensorPlace& place) { return place.experts == 8 ? base : T::kQ5_K; }

// Q4_K_S: the first four attn_v and the first eighth of the layers' ffn_down Q5_K.
T q4_k_s_attention_v(T base, const GgufTensorPlace& place) { return place.index < 4 ? T::kQ5_K : base; }
T q4_k_s_ffn_down(T base, const GgufTensorPlace& place) { return place.index < place.count / 8 ? T::kQ5_K : base; }

// ---- What every quantized file type shares ---------------------------------------------------

// The kinds of tensor llama.cpp's rules tell apart (tensor_get_category, less the kinds whose
// rules only its IQ file types have; MXFP4_MOE's tell banks of experts from the rest).
enum class TensorKind { kOutput, kTokenEmbedding, kAttentionV, kAttentionK, kAttentionOutput, kFfnDown, kOther };

// tensor_get_category's name tests after the exact output / token_embd names, first match wins.
const std::pair<const char*, TensorKind> kKindsByNamePart[] = {
    {"attn_qkv.weight", TensorKind::kAttentionV},  // fused q, k, v: attn_v's rules
    {"attn_kv_b.weight", TensorKind::kAttentionV},
    {"attn_v.weight", TensorKind::kAttentionV},
    {"attn_k.weight", TensorKind::kAttentionK},
    {"attn_q.weight", TensorKind::kOther},
    {"attn_output.weight", TensorKind::kAttentionOutput},
    {"ffn_up", TensorKind::kOther},
    {"ffn_gate", TensorKind::kOther},
    {"ffn_down", TensorKind::kFfnDown},
};

bool contains(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

TensorKind kind_of(const std::string& name) {
  if (name == "output.weight") return TensorKind::kOutput;
  if (name == "token_embd.weight" || name == "per_layer_token_embd.weight") return TensorKind::kTokenEmbedding;
  for (const auto& [part, kind] : kKindsByNamePart) {
    if (contains(name, part)) return kind;
  }
  return TensorKind::kOther;
}

// tensor_allows_quantization's exclusions that a decoder's names can meet (the rest name RWKV,
// Mamba, T5 and vision tensors): norms, an MoE router, positional and token-type embeddings.
const char* const kKeptNameParts[] = {"_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj"};
const char* const kKeptNames[] = {"position_embd.weight", "token_types.weight"};

// ggml_n_dims: the dimensions up to the last ggml extent above 1 (torch's leading 1s do not count).
size_t ggml_dimensions(const std::vector<int64_t>& shape) {
  const auto first = std::find_if(shape.begin(), shape.end(), [](int64_t extent) { return extent != 1; });
  return std::max<size_t>(1, static_cast<size_t>(shape.end() - first));
}

// tensor_allows_quantization: 2-D (or 3-D expert) tensors named "...weight", less the kept ones.
bool llama_cpp_quantizes(const GgufTensorShape& tensor) {
  const auto& name = tensor.name;
  const std::string suffix = "weight";
  if (ggml_dimensions(tensor.shape) < 2) return false;
  if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  for (const char* part : kKeptNameParts) {
    if (contains(name, part)) return false;
  }
  return std::find(std::begin(kKeptNames), std::end(kKeptNames), name) == std::end(kKeptNames);
}

// The `N` of "blk.N.", or -1 (sscanf "blk.%d.", as llama.cpp reads a tensor's layer).
int64_t layer_of(const std::string& name) {
  int layer = -1;
  return std::sscanf(name.c_str(), "blk.%d.", &layer) == 1 ? layer : -1;
}

int64_t block_elements(T type) { return gguf_block_format(type).block_elements; }

// The output projection, and token_embd when it is tied to it: Q8_0 where the base type's block
// does not divide its rows, else Q6_K (Q8_0 files keep Q8_0).
T output_type(T base, int64_t row_length) {
  if (row_length % block_elements(base) != 0 || base == T::kQ8_0) return T::kQ8_0;
  return T::kQ6_K;
}

// llama.cpp types an 80-layer model LLM_TYPE_70B (load_hparams) for these architectures: llama's
// with grouped-query attention (without, it is the 65B) and qwen2's. attn_v gets Q5_K for Q3_K or
// Q4_K there, since its 8 query heads per kv head make it small.
struct SeventyBillionRule {
  const char* architecture;
  bool needs_grouped_queries;
};
const SeventyBillionRule kSeventyBillionRules[] = {{"llama", true}, {"qwen2", false}};

bool is_70b(const GgufModelShape& model) {
  if (model.layers != 80) return false;
  return std::any_of(std::begin(kSeventyBillionRules), std::end(kSeventyBillionRules), [&](const SeventyBillionRule& rule) {
    return model.architecture == rule.architecture && (!rule.needs_grouped_queries || model.heads != model.kv_heads);
  });
}

// attn_v / attn_qkv: the mix's rule, the 70B bump, and Q8_0 in any 8-expert model.
T attention_v_type(const GgufFileType& file_type, const GgufModelShape& model, const GgufTensorPlace& place) {
  T type = file_type.attention_v ? file_type.attention_v(file_type.base_type, place) : file_type.base_type;
  if (is_70b(model) && (type == T::kQ3_K || type == T::kQ4_K)) type = T::kQ5_K;
  return place.experts == 8 ? T::kQ8_0 : type;
}

// tensor_type_fallback: a type whose block does not divide the row (ne0, the last torch
// dimension) falls back to a type of blocks of 32, or to F16 where 32 does not divide it either.
T fallback_type(T type, int64_t row_length) {
  if (row_length % block_elements(type) == 0) return type;
  const std::pair<T, T> kFallbacks[] = {
      {T::kQ2_K, T::kQ4_0}, {T::kQ3_K, T::kQ4_0}, {T::kQ4_K, T::kQ5_0}, {T::kQ5_K, T::kQ5_1}, {T::kQ6_K, T::kQ8_0}};
  for (const auto& [from, to] : kFallbacks) {
    if (from == type && row_length % block_elements(to) == 0) return to;
  }
  return T::kF16;
}

// The tensors in the order llama.cpp's loader keeps them (weight_name_comparer: the tensors
// outside any block first, then block by block, by name within each), which its counters follow.
std::vector<size_t> loader_order(const std::vector<GgufTensorShape>& tensors) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(layer_of(tensors[a].name), tensors[a].name) < std::pair(layer_of(tensors[b].name), tensors[b].name);
  });
  return order;
}

}  // namespace

const std::vector<GgufFileType>& gguf_file_types() {
  // llama.h's numbers, llama_ftype_get_default_type's base types, and the mixes.
  static const std::vector<GgufFileType> rows = {
      // name     llama_ftype base        attn_v / attn_qkv       ffn_down                attn_output
      {"F32",     0,          T::kF32},
      {"F16",     1,          T::kF16},
      {"BF16",    32,         T::kBF16},
      {"Q8_0",    7,          T::kQ8_0},
      {"Q4_0",    2,          T::kQ4_0},
      {"Q4_1",    3,          T::kQ4_1},
      {"Q5_0",    8,          T::kQ5_0},
      {"Q5_1",    9,          T::kQ5_1},
      {"Q2_K",    10,         T::kQ2_K,   q2_k_attention_v,       q2_k_ffn_down,          q2_k_attention_output},
      {"Q3_K_S",  11,         T::kQ3_K,   nullptr,                nullptr,                q5_k_with_eight_experts},
      {"Q3_K_M",  12,         T::kQ3_K,   q3_k_m_attention_v,     q3_k_m_ffn_down,        q3_k_m_attention_output},
      {"Q3_K_L",  13,         T::kQ3_K,   always_q5_k,            always_q5_k,            q3_k_l_attention_output},
      {"Q4_K_S",  14,         T::kQ4_K,   q4_k_s_attention_v,     q4_k_s_ffn_down,        q5_k_with_eight_experts},
      {"Q4_K_M",  15,         T::kQ4_K,   q6_k_where_more_bits,   q6_k_where_more_bits,   q5_k_with_eight_experts},
      {"Q5_K_S",  16,         T::kQ5_K},
      {"Q5_K_M",  17,         T::kQ5_K,   q6_k_where_more_bits,   q6_k_where_more_bits},
      {"Q6_K",    18,         T::kQ6_K},
      {"MXFP4_MOE", 38,       T::kMXFP4,  nullptr,                nullptr,                nullptr,  /*experts_only=*/true},
  };
  return rows;
}

std::string gguf_file_type_names() {
  std::string names;
  for (const auto& file_type : gguf_file_types()) names += (names.empty() ? "" : ", ") + std::string(file_type.name);
  return names;
}

const GgufFileType& find_gguf_file_type(const std::string& name, const std::string& key) {
  for (const auto& file_type : gguf_file_types()) {
    if (name == file_type.name) return file_type;
  }
  // A flag is the command line's; any other key is the recipe's.
  const auto code = key.rfind("--", 0) == 0 ? ErrorCode::kUsage : ErrorCode::kRecipe;
  throw Error(code, key + ": unknown GGUF file type '" + name + "' (expected one of " + gguf_file_type_names() + ")");
}

std::vector<GgufBlockType> gguf_tensor_types(const GgufFileType& file_type, const GgufModelShape& model,
                                             const std::vector<GgufTensorShape>& tensors) {
  const T base = file_type.base_type;
  std::vector<T> types(tensors.size(), T::kF32);
  // llama.cpp counts every attn_v-like tensor, and treats the embeddings as tied until it meets
  // output.weight.
  int64_t attention_v_count = 0;
  bool has_output = false;
  for (const auto& tensor : tensors) {
    attention_v_count += kind_of(tensor.name) == TensorKind::kAttentionV;
    has_output = has_output || kind_of(tensor.name) == TensorKind::kOutput;
  }
  const int64_t query_groups = model.kv_heads > 0 ? model.heads / model.kv_heads : 0;
  int64_t attention_v_seen = 0;  // i_attention_wv
  int64_t ffn_down_seen = 0;     // i_ffn_down
  for (const size_t index : loader_order(tensors)) {
    const auto& tensor = tensors[index];
    if (!llama_cpp_quantizes(tensor)) continue;  // keeps the source's F32
    if (block_elements(base) == 1) {             // F32, F16, BF16: no mix, no fallback
      types[index] = base;
      continue;
    }
    const int64_t row_length = tensor.shape.back();
    if (file_type.experts_only) {  // ggml's ne[2] > 1: a bank of experts
      const bool bank = tensor.shape.size() >= 3 && tensor.shape[tensor.shape.size() - 3] > 1;
      types[index] = fallback_type(bank ? base : T::kQ8_0, row_length);
      continue;
    }
    T type = base;
    switch (kind_of(tensor.name)) {
      case TensorKind::kOutput:
        type = output_type(base, row_length);
        break;
      case TensorKind::kTokenEmbedding:
        if (!has_output) type = output_type(base, row_length);
        break;
      case TensorKind::kAttentionV:
        type = attention_v_type(file_type, model, {attention_v_seen++, attention_v_count, query_groups, model.experts});
        break;
      case TensorKind::kAttentionK:
        if (model.experts == 8) type = T::kQ8_0;
        break;
      case TensorKind::kFfnDown: {
        // A dense model's layer is its ffn_down's place in the loader's order; an MoE model's
        // tensors say theirs in the name.
        const int64_t layer = model.experts > 1 ? layer_of(tensor.name) : ffn_down_seen;
        ++ffn_down_seen;
        if (model.experts > 1 && (layer < 0 || layer >= model.layers)) {
          throw Error(ErrorCode::kWeights, tensor.name + ": no layer in [0, " + std::to_string(model.layers) +
                                               ") in its name, which llama.cpp's quantizer needs for an expert tensor");
        }
        if (file_type.ffn_down) type = file_type.ffn_down(base, {layer, model.layers, query_groups, model.experts});
        break;
      }
      case TensorKind::kAttentionOutput:
        if (file_type.attention_output) type = file_type.attention_output(base, {0, 0, query_groups, model.experts});
        break;
      case TensorKind::kOther:
        break;
    }
    types[index] = fallback_type(type, row_length);
  }
  return types;
}

}  // namespace qtrain::qat
