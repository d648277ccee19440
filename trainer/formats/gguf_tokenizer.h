#pragma once
// The tokenizer of a GGUF file: tokenizer.ggml.* metadata that llama.cpp's llama-vocab.cpp reads,
// from a Hugging Face model directory's tokenizer.json (+ tokenizer_config.json,
// chat_template.jinja), as convert_hf_to_gguf.py writes it. Two kinds of BPE tokenizer.json:
//   byte-level (Llama 3, Qwen, Phi-4-mini / GPT-4o's o200k, GPT-2)  -> "gpt2" vocabulary: tokens,
//       merges, and tokenizer.ggml.pre naming llama.cpp's built-in regexes for the file's Split
//       regexes (a table, one row per pre name);
//   sentencepiece-style (Llama 2, Mistral, Gemma, Phi-3: "▁" for spaces, <0xXX> byte fallback)
//       -> "llama" vocabulary: tokens, scores that make llama.cpp's sentencepiece merging follow
//       the merges' order, token types, add_space_prefix (a table of the normalizer /
//       pre-tokenizer layouts).
// What llama.cpp would tokenize differently is an Error naming the tokenizer.json key.
#include <string>
#include <utility>
#include <vector>

#include "trainer/formats/base_directory.h"
#include "trainer/formats/gguf_file.h"

namespace qtrain::trainer {

// The tokenizer.ggml.* metadata of `base`'s tokenizer for a model of its config (tokens padded
// to config.json's vocab_size). Error for tokenizers llama.cpp would tokenize differently,
// naming the tokenizer.json key (model.type, normalizer, pre_tokenizer, post_processor, ...).
std::vector<std::pair<std::string, GgufValue>> gguf_tokenizer_metadata(const BaseDirectory& base);

}  // namespace qtrain::trainer
