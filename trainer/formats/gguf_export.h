#pragma once
// GGUF export: a model (any run's, or a QAT run's integer weights) written as one GGUF v3 file that llama.cpp runs, laid out
// as llama.cpp's convert_hf_to_gguf.py lays out its architecture (llama for Llama and Mistral,
// qwen2, qwen3, phi3, gemma2, gemma3; ModelFamily::gguf, trainer/formats/gguf_architecture.h):
//   metadata   general.* (architecture, name, file_type), ARCH.* hyperparameters, and the
//              tokenizer (tokenizer.ggml.*, trainer/formats/gguf_tokenizer.h)
//   tensors    token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
//              ffn_gate, ffn_up, ffn_down} (+ attn_q/k/v biases for Qwen2, attn_q_norm /
//              attn_k_norm for Qwen3), output_norm, output (absent with tied embeddings)
// For llama, the rows of attn_q / attn_k are permuted as convert_hf_to_gguf's LlamaModel.permute
// does (llama.cpp rotates adjacent pairs where transformers rotates halves); Qwen's architectures
// rotate halves in llama.cpp too, and keep transformers' rows.
// Tensor types: with a llama.cpp file type (GgufExportOptions::file_type, `--gguf-type Q4_K_M`),
// each tensor gets the type llama-quantize would give it (qat/gguf_file_types.h) and the bytes
// llama-quantize would write from the F32 file (qat/gguf_quants.h): post-training quantization,
// except for QAT layers trained on that tensor's type, whose codes and scales are written as they
// are (a row permutation moves whole blocks, so the file dequantizes to the fake-quant weights bit
// for bit). Without one (auto), QAT layers whose scheme is a GGUF type (qat::gguf_block_type_for:
// symmetric int4 / int8, groups of 32, fp16 scales) are written as their Q4_0 / Q8_0 blocks and
// every other tensor is F32 (exact). What llama.cpp's architecture cannot hold (a sliding window
// shorter than the context, biases or norms it does not read) is an error.
#include <map>
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"
#include "qat/gguf_file_types.h"
#include "trainer/formats/base_directory.h"
#include "trainer/formats/gguf_architecture.h"
#include "trainer/formats/gguf_file.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

struct GgufExportOptions {
  std::string name;  // general.name; empty: the base directory's name
  // The llama.cpp file type to write (--gguf-type, export.gguf_type): each tensor gets the type
  // llama-quantize gives it, from the QAT layer's codes where it trained on that type's grid,
  // else quantized by llama.cpp's own quantizer (bit for bit as llama-quantize of the F32 file).
  // Null (auto): QAT layers as the blocks they trained on, every other tensor F32.
  const qat::GgufFileType* file_type = nullptr;
  std::string weights_key = "qat.weights";  // the recipe key errors about the scheme name
};

// The file type named `name` (--gguf-type, export.gguf_type), null for auto
// (qat::kGgufFileTypeAuto); an Error naming `key` for any other name.
const qat::GgufFileType* parse_gguf_type(const std::string& name, const std::string& key);

// The row order convert_hf_to_gguf gives a q_proj / k_proj weight of `rows` rows in `heads`
// heads: GGUF row r holds Hugging Face row order[r]. int64 [rows].
torch::Tensor gguf_rope_row_order(int64_t rows, int64_t heads);

// Error, as write_gguf_model would give it, when a model of `base`'s config with its tokenizer
// cannot be written as GGUF: for runs to check before they train, not after.
void require_gguf_exportable(const BaseDirectory& base);

// The block type llama.cpp's quantizer gives each linear layer of `model` (by module path, as
// qat::find_linear_layers names it) in a file of `file_type`: what QAT on a GGUF file type
// (qat.weights.format: gguf) trains each layer on, so that the export writes its codes as they are.
std::map<std::string, qat::GgufBlockType> gguf_layer_types(const torch::nn::Module& model, const HfModelConfig& config,
                                                           const qat::GgufFileType& file_type);

// Writes `model` as the GGUF file `out_file`. `base` supplies the config and the tokenizer.
void write_gguf_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_file,
                      const GgufExportOptions& options = {});

}  // namespace qtrain::trainer
