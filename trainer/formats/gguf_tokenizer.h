#pragma once
// The tokenizer of a GGUF file: tokenizer.ggml.* metadata that llama.cpp's llama-vocab.cpp reads,
// from a Hugging Face model directory's tokenizer.json (+ tokenizer_config.json,
// chat_template.jinja), as convert_hf_to_gguf.py writes it.
#include <string>
#include <utility>
#include <vector>

#include "trainer/formats/base_directory.h"
#include "trainer/formats/gguf_file.h"

namespace qtrain::trainer {

// The tokenizer.ggml.* metadata of `base`'s tokenizer for a model of its config. Error for
// tokenizers llama.cpp would tokenize differently, naming the tokenizer.json key.
std::vector<std::pair<std::string, GgufValue>> gguf_tokenizer_metadata(const BaseDirectory& base);

}  // namespace qtrain::trainer
