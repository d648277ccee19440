#pragma once
// GGUF export: a (QAT-trained) model written as one GGUF v3 file that llama.cpp runs, laid out
// as llama.cpp's convert_hf_to_gguf.py lays out its architecture (llama for Llama and Mistral,
// qwen2, qwen3, phi3, gemma2, gemma3; ModelFamily::gguf, trainer/formats/gguf_architecture.h):
//   metadata   general.* (architecture, name, file_type), ARCH.* hyperparameters, and the
//              tokenizer (tokenizer.ggml.*: Llama-3-style byte-level BPE as model "gpt2" with
//              its pre-tokenizer, tokens, token types, merges, special ids, chat template)
//   tensors    token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
//              ffn_gate, ffn_up, ffn_down} (+ attn_q/k/v biases for Qwen2, attn_q_norm /
//              attn_k_norm for Qwen3), output_norm, output (absent with tied embeddings)
// For llama, the rows of attn_q / attn_k are permuted as convert_hf_to_gguf's LlamaModel.permute
// does (llama.cpp rotates adjacent pairs where transformers rotates halves); Qwen's architectures
// rotate halves in llama.cpp too, and keep transformers' rows. QAT layers whose weight
// scheme is GGUF's (qat::gguf_block_type_for: symmetric int4 / int8, groups of 32, fp16 scales)
// are written as Q4_0 / Q8_0 blocks of their codes and scales: a row permutation moves whole
// blocks, so the file dequantizes to the fake-quant weights bit for bit (rows permuted). Every
// other tensor is F32 (exact), or F16 for 2-D weights when the options ask. What llama.cpp's
// architecture cannot hold (a sliding window shorter than the context, biases or norms it does
// not read) is an error.
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"
#include "trainer/formats/base_directory.h"
#include "trainer/formats/gguf_architecture.h"
#include "trainer/formats/gguf_file.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

struct GgufExportOptions {
  std::string name;                                       // general.name; empty: the base directory's name
  qat::GgufBlockType float_type = qat::GgufBlockType::kF32;  // non-QAT 2-D weights: F32 or F16 (norms stay F32)
  std::string weights_key = "qat.weights";                // the recipe key errors about the scheme name
};

// The row order convert_hf_to_gguf gives a q_proj / k_proj weight of `rows` rows in `heads`
// heads: GGUF row r holds Hugging Face row order[r]. int64 [rows].
torch::Tensor gguf_rope_row_order(int64_t rows, int64_t heads);

// Error, as write_gguf_model would give it, when a model of `base`'s config with its tokenizer
// cannot be written as GGUF: for runs to check before they train, not after.
void require_gguf_exportable(const BaseDirectory& base);

// Writes `model` as the GGUF file `out_file`. `base` supplies the config and the tokenizer.
void write_gguf_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_file,
                      const GgufExportOptions& options = {});

}  // namespace qtrain::trainer
