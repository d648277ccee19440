#pragma once
// Chat templates without a Jinja engine: qtrain recognises the family a model's template
// belongs to and renders that family in C++, character for character as transformers'
// apply_chat_template renders the template. Families:
//   llama3          {{bos}}<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT|trim<|eot_id|> ...
//   chatml          <|im_start|>ROLE\nCONTENT<|im_end|>\n ...  (no BOS; optional default system
//                   prompt when the first message is not a system message, as Qwen2.5's does)
//   qwen3           chatml with reasoning: an assistant turn after the last user query carries
//                   <think>\nREASONING\n</think>\n\n (always on the last turn; reasoning is read
//                   from <think>...</think> in the content), earlier turns lose theirs; tool
//                   results are user turns of <tool_response> blocks (Qwen3's hybrid template)
//   qwen3-instruct  the same, with a think block only where there is reasoning (Qwen3-2507 Instruct)
//   qwen3-thinking  the hybrid's turns; the generation prompt opens <think>\n (Qwen3-2507 Thinking)
//   mistral-v1      {{bos}}[INST] USER [/INST]ASSISTANT{{eos}} ...  (Mistral 7B v0.1 / v0.2)
//   mistral-v3      {{bos}}[INST] USER[/INST] ASSISTANT|trim{{eos}} ...; the system message opens
//                   the last user turn (Mistral 7B v0.3)
//   gemma           {{bos}}<start_of_turn>user\nCONTENT|trim<end_of_turn>\n<start_of_turn>model\n ...;
//                   no system message, turns alternate (Gemma 1 and Gemma 2 -it)
//   gemma3          gemma's turns; a first system message opens the first turn's text, SYSTEM\n\n
//                   (Gemma 3 -it; text content only)
//   phi3            <|ROLE|>\nCONTENT<|end|>\n for system / user / assistant, then {{eos}} or the
//                   generation prompt <|assistant|>\n (Phi-3-mini); phi3.5 skips an empty system
//                   message (Phi-3.5-mini)
//   phi4-mini       <|ROLE|>CONTENT<|end|> for every message, then {{eos}} or <|assistant|>
// Rendering in segments marks what a model learns to say: assistant content (with its reasoning)
// and its end-of-turn token are trainable, everything else (headers, other roles) is not.
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace qtrain::data {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
  // An assistant's reasoning given apart from its content ("reasoning_content", as Qwen3's
  // template reads it); the templates without reasoning ignore it, as transformers does.
  std::optional<std::string> reasoning_content = std::nullopt;
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
                                         const std::string& bos_token, const std::string& eos_token = "");
  // One of supported_families(). bos_token / eos_token are what the template's {{ bos_token }} /
  // {{ eos_token }} render.
  static ChatTemplate named(const std::string& family, const std::string& bos_token = "<|begin_of_text|>",
                            const std::string& eos_token = "");

  static std::vector<std::string> supported_families();

  std::string family() const;
  const std::optional<std::string>& default_system_prompt() const { return default_system_prompt_; }

  // Adjacent segments of equal trainability are joined; their concatenation is render().
  std::vector<ChatSegment> render_segments(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

 private:
  enum class Family {
    kLlama3, kChatml, kQwen3, kQwen3Instruct, kQwen3Thinking, kMistralV1, kMistralV3, kGemma, kGemma3, kPhi3, kPhi35,
    kPhi4Mini
  };
  // Each family with the name data.chat_template gives it.
  static const std::vector<std::pair<Family, const char*>>& family_names();
  ChatTemplate(Family family, std::string bos_token, std::string eos_token,
               std::optional<std::string> default_system_prompt = std::nullopt)
      : family_(family),
        bos_token_(std::move(bos_token)),
        eos_token_(std::move(eos_token)),
        default_system_prompt_(std::move(default_system_prompt)) {}

  Family family_;
  std::string bos_token_;
  std::string eos_token_;
  std::optional<std::string> default_system_prompt_;  // chatml only
  // chatml: the template turns tool results into user turns of <tool_response> blocks (Qwen2.5),
  // which the chatml family does not render: a tool message is an error.
  bool tool_responses_ = false;
};

}  // namespace qtrain::data
