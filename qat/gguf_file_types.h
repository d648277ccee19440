#pragma once
// llama.cpp's file types (llama.h's llama_ftype: what `llama-quantize MODEL OUT Q4_K_M` names),
// one row each, and the type llama.cpp's quantizer gives each tensor of a model for one of them
// (src/llama-quant.cpp's llama_tensor_get_type without an importance matrix, --pure or any
// override: the _S / _M / _L mixes, the output and token_embd rules, and the fallbacks for rows
// that are not a multiple of a K-quant's 256). `qtrain export --gguf-type`, export.gguf_type and
// qat.weights.gguf_type name these rows. Free of LibTorch (the recipe's fuzz target links it).
//
// A new file type is one row of gguf_file_types.cpp's table; its mix is the rules of
// gguf_tensor_types() that name it.
#include <cstdint>
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"

namespace qtrain::qat {

struct GgufFileType {
  const char* name;         // llama-quantize's name: "Q4_K_M", "Q8_0", "F16"
  uint32_t llama_ftype;     // general.file_type (LLAMA_FTYPE_MOSTLY_Q4_K_M = 15)
  GgufBlockType base_type;  // the type most 2-D weights get (llama-quant.cpp's default_type)
};

// Every file type `--gguf-type` takes, in llama.h's order.
const std::vector<GgufFileType>& gguf_file_types();
// "F32, F16, BF16, Q8_0, ..." for messages.
std::string gguf_file_type_names();
// The row named `name`; an Error naming `key` (--gguf-type, export.gguf_type) and the names.
const GgufFileType& find_gguf_file_type(const std::string& name, const std::string& key);

// One tensor of a GGUF file as llama.cpp's quantizer sees it.
struct GgufTensorShape {
  std::string name;            // GGUF name: "blk.3.ffn_down.weight", "token_embd.weight", "output.weight"
  std::vector<int64_t> shape;  // torch order, [rows, columns] for a 2-D weight (ggml's ne reversed)
};

// The hyperparameters llama_tensor_get_type reads.
struct GgufModelShape {
  std::string architecture;  // general.architecture: "llama", "qwen3", ...
  int64_t layers = 0;        // block_count
  int64_t heads = 0;         // attention.head_count
  int64_t kv_heads = 0;      // attention.head_count_kv
  int64_t experts = 0;       // expert_count (0: dense)
};

// The type llama.cpp's quantizer writes for each tensor of `tensors` (in order) when asked for
// `file_type`, as llama_model_quantize with default parameters: 1-D tensors and norms keep F32
// (tensors listed here are F32 in the source file), 2-D weights get the mix's type.
std::vector<GgufBlockType> gguf_tensor_types(const GgufFileType& file_type, const GgufModelShape& model,
                                             const std::vector<GgufTensorShape>& tensors);

}  // namespace qtrain::qat
