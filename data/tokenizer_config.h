#pragma once
// What qtrain reads from a model directory's tokenizer_config.json: the names of the special
// tokens transformers uses (bos/eos/pad) and the chat template, if it is kept there.
#include <optional>
#include <string>

namespace qtrain::data {

struct TokenizerConfig {
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::optional<std::string> pad_token;
  // The "chat_template" value: a string, or the template named "default" of a list of them.
  std::optional<std::string> chat_template;

  // Error naming the file when it is not JSON or a key has the wrong type.
  static TokenizerConfig read(const std::string& path);
  // MODEL_DIR/tokenizer_config.json, or an empty config when the file does not exist.
  static TokenizerConfig read_from_model_dir(const std::string& model_dir);
};

}  // namespace qtrain::data
