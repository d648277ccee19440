#pragma once
// Chat templates without a Jinja engine: qtrain recognises the family a model's template
// belongs to and renders that family in C++, character for character as transformers'
// apply_chat_template renders the template. Families:
//   llama3  {{bos}}<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT|trim<|eot_id|> ...
//   chatml  <|im_start|>ROLE\nCONTENT<|im_end|>\n ...  (no BOS; optional default system
//           prompt when the first message is not a system message, as Qwen's templates do)
// Rendering in segments marks what a model learns to say: assistant content and its
// end-of-turn token are trainable, everything else (headers, other roles) is not.
#include <optional>
#include <string>
#include <vector>

namespace qtrain::data {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

struct ChatSegment {
  std::string text;
  bool trainable;  // assistant content + its end-of-turn token (for loss masking)
};

class ChatTemplate {
 public:
  // The family of DIR/chat_template.jinja, or else of tokenizer_config.json's
  // "chat_template"; bos_token from tokenizer_config.json. A non-empty forced_family
  // (the recipe's data.chat_template) skips detection. Error when no template is found or
  // the template is not one of the supported families.
  static ChatTemplate from_model_dir(const std::string& model_dir, const std::string& forced_family = "");
  // The family of a template's text; `source` names where it came from, for errors.
  static ChatTemplate from_template_text(const std::string& template_text, const std::string& source,
                                         const std::string& bos_token);
  // "llama3" | "chatml". bos_token is what the template's {{ bos_token }} renders.
  static ChatTemplate named(const std::string& family, const std::string& bos_token = "<|begin_of_text|>");

  static std::vector<std::string> supported_families();

  std::string family() const;
  const std::optional<std::string>& default_system_prompt() const { return default_system_prompt_; }

  // Adjacent segments of equal trainability are joined; their concatenation is render().
  std::vector<ChatSegment> render_segments(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

 private:
  enum class Family { kLlama3, kChatml };
  ChatTemplate(Family family, std::string bos_token, std::optional<std::string> default_system_prompt)
      : family_(family), bos_token_(std::move(bos_token)), default_system_prompt_(std::move(default_system_prompt)) {}

  Family family_;
  std::string bos_token_;
  std::optional<std::string> default_system_prompt_;  // chatml only
};

}  // namespace qtrain::data
