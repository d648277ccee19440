#pragma once
// llama.cpp's file types (llama.h's llama_ftype: what `llama-quantize MODEL OUT Q4_K_M` names),
// one row each, and the type llama.cpp's quantizer gives each tensor of a model for one of them
// (src/llama-quant.cpp's llama_tensor_get_type without an importance matrix, --pure or any
// override: the _S / _M / _L mixes, the output and token_embd rules, and the fallbacks for rows
// that are not a multiple of a K-quant's 256). `qtrain export --gguf-type`, export.gguf_type and
// qat.weights.gguf_type name these rows. Free of LibTorch (the recipe's fuzz target links it).
//
// A new file type is one row of gguf_file_types.cpp's table: its name, number and base type, and
// for a K-quant mix the rules that give some tensors more bits than the base type.
#include <cstdint>
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"

namespace qtrain::qat {

// Where a tensor sits among those a mix's rule counts, as llama_tensor_get_type counts them.
struct GgufTensorPlace {
  int64_t index = 0;         // attn_v / attn_qkv: how many came before it (i_attention_wv); ffn_down: its layer
  int64_t count = 0;         // attn_v / attn_qkv: how many the model has (n_attention_wv); ffn_down: block_count
  int64_t query_groups = 0;  // attention.head_count / head_count_kv, rounded down (n_gqa; 0 without kv heads)
  int64_t experts = 0;       // expert_count (0: dense)
};

// A mix's type for one kind of tensor: the file type's base_type (`base`) or one with more bits.
using GgufMixRule = GgufBlockType (*)(GgufBlockType base, const GgufTensorPlace& place);

struct GgufFileType {
  const char* name;         // llama-quantize's name: "Q4_K_M", "Q8_0", "F16"
  uint32_t llama_ftype;     // general.file_type (LLAMA_FTYPE_MOSTLY_Q4_K_M = 15)
  GgufBlockType base_type;  // the type most 2-D weights get (llama-quant.cpp's default_type)
  // The mix (llama_tensor_get_type_impl's branches on this ftype); null: the tensor keeps base_type.
  GgufMixRule attention_v = nullptr;       // attn_v.weight and the fused attn_qkv.weight
  GgufMixRule ffn_down = nullptr;          // ffn_down.weight (and MoE ffn_down_exps.weight)
  GgufMixRule attention_output = nullptr;  // attn_output.weight
  // MXFP4_MOE: base_type for the expert banks (3-D tensors of more than one expert) only; every
  // other weight, the output and token_embd too, Q8_0 (the mixes above do not apply).
  bool experts_only = false;
};

// What --gguf-type / export.gguf_type say for "the grid a QAT run trained on, the rest F32".
constexpr const char* kGgufFileTypeAuto = "auto";

// Every file type `--gguf-type` takes: the float types, Q8_0, the legacy types, then the K-quant
// mixes from the fewest bits to the most, then MXFP4_MOE (the experts MXFP4, the rest Q8_0).
const std::vector<GgufFileType>& gguf_file_types();
// "F32, F16, BF16, Q8_0, ..." for messages.
std::string gguf_file_type_names();
// The row named `name` (exactly, as llama-quantize prints it); an Error naming `key`
// (--gguf-type, export.gguf_type) and the names.
const GgufFileType& find_gguf_file_type(const std::string& name, const std::string& key);

// One tensor of a GGUF file as llama.cpp's quantizer sees it.
struct GgufTensorShape {
  std::string name;            // GGUF name: "blk.3.ffn_down.weight", "token_embd.weight", "output.weight"
  std::vector<int64_t> shape;  // torch order, [rows, columns] for a 2-D weight (ggml's ne reversed)
};

// The hyperparameters llama_tensor_get_type reads (the GGUF file's metadata).
struct GgufModelShape {
  std::string architecture;  // general.architecture: "llama", "qwen3", ... (llama's and qwen2's 80-layer 70B rule)
  int64_t layers = 0;        // block_count
  int64_t heads = 0;         // attention.head_count
  int64_t kv_heads = 0;      // attention.head_count_kv
  int64_t experts = 0;       // expert_count (0: dense)
};

// The type llama.cpp's quantizer writes for each tensor of `tensors` (in order) when asked for
// `file_type`, as llama_model_quantize with default parameters: 1-D tensors and norms keep F32
// (tensors listed here are F32 in the source file), 2-D weights get the mix's type. A model
// without output.weight (tied embeddings) gives token_embd.weight the output's type. A row (the
// last torch dimension) that the chosen type's block does not divide takes llama.cpp's fallback:
// Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 where 32 does not divide
// it either. An Error for an MoE expert tensor outside `blk.N.` (llama.cpp refuses it too).
std::vector<GgufBlockType> gguf_tensor_types(const GgufFileType& file_type, const GgufModelShape& model,
                                             const std::vector<GgufTensorShape>& tensors);

}  // namespace qtrain::qat
