#include "trainer/formats/base_directory.h"

#include "data/text_file.h"
#include "data/tokenizer_config.h"
#include "kernels/error.h"
#include "trainer/base/file_system.h"

namespace qtrain::trainer {

namespace {

// What transformers' save_pretrained copies beside the weights for a fast tokenizer (plus a
// sentencepiece model when the base has one); absent ones are skipped.
constexpr const char* kTokenizerFiles[] = {"tokenizer.json",         "tokenizer_config.json", "special_tokens_map.json",
                                           "added_tokens.json",      "tokenizer.model",       "chat_template.jinja",
                                           "chat_template.json"};
constexpr const char* kTokenizerJson = "tokenizer.json";
constexpr const char* kChatTemplateJinja = "chat_template.jinja";

}  // namespace

BaseDirectory BaseDirectory::read(const std::string& path, HfModelConfig config) {
  BaseDirectory base;
  base.path = path;
  base.config = std::move(config);
  for (const char* name : kTokenizerFiles) {
    const std::string file = path + "/" + name;
    if (is_regular_file(file)) base.tokenizer_files.emplace_back(name, data::read_text_file(file, "a tokenizer file"));
  }
  const std::string generation = path + "/generation_config.json";
  if (is_regular_file(generation)) base.generation_config = data::read_text_file(generation, "generation_config.json");
  return base;
}

const std::string* BaseDirectory::file_text(const std::string& name) const {
  for (const auto& [file, text] : tokenizer_files) {
    if (file == name) return &text;
  }
  return nullptr;
}

const std::string& BaseDirectory::tokenizer_json() const {
  const auto* text = file_text(kTokenizerJson);
  if (text == nullptr) {
    throw Error(ErrorCode::kFileSystem, path + "/" + kTokenizerJson + ": cannot open (expected " + kTokenizerJson + ")");
  }
  return *text;
}

const data::Tokenizer& BaseDirectory::tokenizer() const {
  if (!tokenizer_) tokenizer_ = data::Tokenizer::from_model_dir(path);
  return *tokenizer_;
}

std::optional<std::string> BaseDirectory::chat_template() const {
  if (const auto* jinja = file_text(kChatTemplateJinja)) return *jinja;
  return data::TokenizerConfig::read_from_model_dir(path).chat_template;
}

std::string BaseDirectory::name() const {
  auto trimmed = path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  return trimmed.substr(trimmed.find_last_of('/') + 1);
}

}  // namespace qtrain::trainer
