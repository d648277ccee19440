#pragma once
// What an export takes from the base model's Hugging Face directory besides its weights, read
// once into one struct that every writer (merged, safetensors-int, GGUF) and their pre-flight
// checks take:
//   config.json              as the model was loaded with it
//   tokenizer files          the texts transformers' save_pretrained copies beside the weights
//                            (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...), those present
//   generation_config.json   its text, when present
// The tokenizer is parsed from the directory on first use and kept, so that an export which only
// copies the files never parses them, and one that writes GGUF parses them once.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/tokenizer.h"
#include "trainer/formats/hf_config.h"

namespace qtrain::trainer {

struct BaseDirectory {
  std::string path;
  HfModelConfig config;
  std::vector<std::pair<std::string, std::string>> tokenizer_files;  // (file name, text), in save_pretrained's order
  std::optional<std::string> generation_config;                     // generation_config.json's text

  // Reads `path`'s files; `config` is its config.json as the model was loaded.
  static BaseDirectory read(const std::string& path, HfModelConfig config);

  // tokenizer.json's text; an Error naming the file when the directory has none.
  const std::string& tokenizer_json() const;
  // The tokenizer of tokenizer.json and tokenizer_config.json (data::Tokenizer::from_model_dir).
  const data::Tokenizer& tokenizer() const;
  // chat_template.jinja's text, else tokenizer_config.json's chat_template, else none.
  std::optional<std::string> chat_template() const;
  // The directory's own name ("Llama-3.2-1B" of ".../Llama-3.2-1B/").
  std::string name() const;

 private:
  const std::string* file_text(const std::string& name) const;
  mutable std::optional<data::Tokenizer> tokenizer_;  // parsed on first use
};

}  // namespace qtrain::trainer
