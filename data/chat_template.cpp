#include "data/chat_template.h"

#include <filesystem>

#include "data/text_file.h"
#include "data/tokenizer_config.h"
#include "data/utf8.h"
#include "kernels/error.h"

namespace qtrain::data {

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string supported_list() { return "llama3, chatml"; }

// A newline inside a Jinja string literal is written either as itself or as "\n".
size_t skip_newline(const std::string& text, size_t position) {
  if (text.compare(position, 1, "\n") == 0) return position + 1;
  if (text.compare(position, 2, "\\n") == 0) return position + 2;
  return std::string::npos;
}

std::string unescape_jinja_literal(const std::string& literal) {
  std::string out;
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal[i] == '\\' && i + 1 < literal.size()) {
      const char next = literal[++i];
      out += next == 'n' ? '\n' : next == 't' ? '\t' : next;
    } else {
      out += literal[i];
    }
  }
  return out;
}

// A literal system turn in the template, '<|im_start|>system\nTEXT<|im_end|>\n': the prompt
// Qwen's templates insert when the conversation has no system message of its own.
std::optional<std::string> chatml_default_system_prompt(const std::string& text) {
  const std::string opening = "<|im_start|>system";
  for (size_t found = text.find(opening); found != std::string::npos; found = text.find(opening, found + 1)) {
    if (found == 0 || (text[found - 1] != '\'' && text[found - 1] != '"')) continue;
    const char quote = text[found - 1];
    const size_t prompt_begin = skip_newline(text, found + opening.size());
    if (prompt_begin == std::string::npos) continue;
    const size_t literal_end = text.find(quote, prompt_begin);
    const size_t prompt_end = text.find("<|im_end|>", prompt_begin);
    if (literal_end == std::string::npos || prompt_end == std::string::npos || prompt_end > literal_end) continue;
    return unescape_jinja_literal(text.substr(prompt_begin, prompt_end - prompt_begin));
  }
  return std::nullopt;
}

class SegmentWriter {
 public:
  void add(const std::string& text, bool trainable) {
    if (text.empty()) return;
    if (!segments_.empty() && segments_.back().trainable == trainable) {
      segments_.back().text += text;
    } else {
      segments_.push_back({text, trainable});
    }
  }
  std::vector<ChatSegment> take() { return std::move(segments_); }

 private:
  std::vector<ChatSegment> segments_;
};

void check_roles(const std::vector<ChatMessage>& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role.empty()) throw Error(ErrorCode::kTokenizer, "chat message " + std::to_string(i) + " has an empty role");
  }
}

}  // namespace

std::vector<std::string> ChatTemplate::supported_families() { return {"llama3", "chatml"}; }

ChatTemplate ChatTemplate::named(const std::string& family, const std::string& bos_token) {
  if (family == "llama3") return ChatTemplate(Family::kLlama3, bos_token, std::nullopt);
  if (family == "chatml") return ChatTemplate(Family::kChatml, bos_token, std::nullopt);
  throw Error(ErrorCode::kTokenizer, "data.chat_template: unknown chat template family '" + family + "' (supported: " + supported_list() +
              ")");
}

ChatTemplate ChatTemplate::from_template_text(const std::string& text, const std::string& source,
                                              const std::string& bos_token) {
  const std::string force_hint = "; set data.chat_template to one of " + supported_list() +
                                 " to train with that format instead";
  if (contains(text, "<|start_header_id|>") && contains(text, "<|end_header_id|>") && contains(text, "<|eot_id|>")) {
    if (contains(text, "Cutting Knowledge Date")) {
      throw Error(ErrorCode::kTokenizer, source + ": this Llama 3.1+ chat template adds a dated system header ('Cutting Knowledge Date') "
                  "that qtrain's llama3 family does not render" + force_hint);
    }
    return ChatTemplate(Family::kLlama3, bos_token, std::nullopt);
  }
  if (contains(text, "<|im_start|>") && contains(text, "<|im_end|>")) {
    if (contains(text, "<think>")) {
      throw Error(ErrorCode::kTokenizer, source + ": this chatml template renders reasoning blocks (<think>), which qtrain's chatml family "
                  "does not" + force_hint);
    }
    return ChatTemplate(Family::kChatml, bos_token, chatml_default_system_prompt(text));
  }
  throw Error(ErrorCode::kTokenizer, source + ": the chat template is not one qtrain recognises (supported families: " + supported_list() +
              "; qtrain renders templates without a Jinja engine)" + force_hint);
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& model_dir, const std::string& forced_family) {
  const TokenizerConfig config = TokenizerConfig::read_from_model_dir(model_dir);
  const std::string bos_token = config.bos_token.value_or("");
  if (!forced_family.empty()) return named(forced_family, bos_token);
  const std::string jinja_path = model_dir + "/chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) return from_template_text(read_text_file(jinja_path, "a Jinja chat template"), jinja_path, bos_token);
  if (config.chat_template) {
    return from_template_text(*config.chat_template, model_dir + "/tokenizer_config.json: chat_template", bos_token);
  }
  throw Error(ErrorCode::kTokenizer, model_dir + ": no chat template (neither chat_template.jinja nor a \"chat_template\" in "
              "tokenizer_config.json); set data.chat_template to one of " + supported_list());
}

std::string ChatTemplate::family() const { return family_ == Family::kLlama3 ? "llama3" : "chatml"; }

std::vector<ChatSegment> ChatTemplate::render_segments(const std::vector<ChatMessage>& messages,
                                                       bool add_generation_prompt) const {
  check_roles(messages);
  SegmentWriter out;
  if (family_ == Family::kLlama3) {
    out.add(bos_token_, false);
    for (const ChatMessage& message : messages) {
      const bool assistant = message.role == "assistant";
      out.add("<|start_header_id|>" + message.role + "<|end_header_id|>\n\n", false);
      out.add(utf8::strip_python_space(message.content) + "<|eot_id|>", assistant);
    }
    if (add_generation_prompt) out.add("<|start_header_id|>assistant<|end_header_id|>\n\n", false);
  } else {
    if (default_system_prompt_ && (messages.empty() || messages.front().role != "system")) {
      out.add("<|im_start|>system\n" + *default_system_prompt_ + "<|im_end|>\n", false);
    }
    for (const ChatMessage& message : messages) {
      const bool assistant = message.role == "assistant";
      out.add("<|im_start|>" + message.role + "\n", false);
      out.add(message.content + "<|im_end|>", assistant);
      out.add("\n", false);
    }
    if (add_generation_prompt) out.add("<|im_start|>assistant\n", false);
  }
  return out.take();
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string text;
  for (const ChatSegment& segment : render_segments(messages, add_generation_prompt)) text += segment.text;
  return text;
}

}  // namespace qtrain::data
