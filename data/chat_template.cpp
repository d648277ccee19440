#include "data/chat_template.h"

#include <filesystem>

#include "data/text_affixes.h"
#include "data/text_file.h"
#include "data/tokenizer_config.h"
#include "data/utf8.h"
#include "kernels/error.h"

namespace qtrain::data {

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A string literal of the template, with its newlines written as "\n" or as themselves.
bool contains_literal(const std::string& text, const std::string& literal) {
  std::string raw;
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal.compare(i, 2, "\\n") == 0) {
      raw += '\n';
      ++i;
    } else {
      raw += literal[i];
    }
  }
  return contains(text, literal) || contains(text, raw);
}

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

std::string lstrip_newlines(const std::string& text) {
  const size_t begin = text.find_first_not_of('\n');
  return begin == std::string::npos ? std::string() : text.substr(begin);
}
std::string rstrip_newlines(const std::string& text) {
  const size_t end = text.find_last_not_of('\n');
  return end == std::string::npos ? std::string() : text.substr(0, end + 1);
}

void render_llama3(const std::vector<ChatMessage>& messages, const std::string& bos_token, SegmentWriter& out) {
  out.add(bos_token, false);
  for (const ChatMessage& message : messages) {
    out.add("<|start_header_id|>" + message.role + "<|end_header_id|>\n\n", false);
    out.add(utf8::strip_python_space(message.content) + "<|eot_id|>", message.role == "assistant");
  }
}

void render_chatml(const std::vector<ChatMessage>& messages, const std::optional<std::string>& default_system_prompt,
                   bool tool_responses, SegmentWriter& out) {
  for (size_t index = 0; index < messages.size(); ++index) {
    if (tool_responses && messages[index].role == "tool") {
      throw Error(ErrorCode::kTokenizer, "chat message " + std::to_string(index) + " is a tool result: this model's template "
                  "renders those as <tool_response> blocks in user turns (Qwen2.5), which qtrain's chatml family does "
                  "not render; leave tool messages out of the data");
    }
  }
  if (default_system_prompt && (messages.empty() || messages.front().role != "system")) {
    out.add("<|im_start|>system\n" + *default_system_prompt + "<|im_end|>\n", false);
  }
  for (const ChatMessage& message : messages) {
    out.add("<|im_start|>" + message.role + "\n", false);
    out.add(message.content + "<|im_end|>", message.role == "assistant");
    out.add("\n", false);
  }
}

// Qwen3's templates. `think_on_last_turn`: the final assistant turn always carries a think
// block, empty without reasoning (the hybrid and Thinking templates); otherwise only turns with
// reasoning do (Instruct-2507).
void render_qwen3(const std::vector<ChatMessage>& messages, bool think_on_last_turn, SegmentWriter& out) {
  const auto is_tool_response = [](const std::string& content) {
    return starts_with(content, "<tool_response>") && ends_with(content, "</tool_response>");
  };
  // The last user message that is a query (not tool output pasted as a user turn).
  size_t last_query = messages.empty() ? 0 : messages.size() - 1;
  for (size_t index = messages.size(); index-- > 0;) {
    if (messages[index].role == "user" && !is_tool_response(messages[index].content)) {
      last_query = index;
      break;
    }
  }
  for (size_t index = 0; index < messages.size(); ++index) {
    const ChatMessage& message = messages[index];
    const bool last = index + 1 == messages.size();
    if (message.role == "user" || message.role == "system") {
      out.add("<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n", false);
    } else if (message.role == "assistant") {
      std::string content = message.content, reasoning;
      const std::string close = "</think>";
      if (message.reasoning_content) {
        reasoning = *message.reasoning_content;
      } else if (contains(content, close)) {
        // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
        const std::string before = rstrip_newlines(content.substr(0, content.find(close)));
        const size_t open = before.rfind("<think>");
        reasoning = lstrip_newlines(open == std::string::npos ? before : before.substr(open + 7));
        content = lstrip_newlines(content.substr(content.rfind(close) + close.size()));
      }
      out.add("<|im_start|>assistant\n", false);
      const bool think_block = index > last_query && (!reasoning.empty() || (think_on_last_turn && last));
      if (think_block) {
        out.add("<think>\n" + lstrip_newlines(rstrip_newlines(reasoning)) + "\n</think>\n\n" + lstrip_newlines(content), true);
      } else {
        out.add(content, true);
      }
      out.add("<|im_end|>", true);
      out.add("\n", false);
    } else if (message.role == "tool") {
      if (index == 0 || messages[index - 1].role != "tool") out.add("<|im_start|>user", false);
      out.add("\n<tool_response>\n" + message.content + "\n</tool_response>", false);
      if (last || messages[index + 1].role != "tool") out.add("<|im_end|>\n", false);
    } else {
      throw Error(ErrorCode::kTokenizer, "chat message " + std::to_string(index) + " has role '" + message.role +
                  "', which Qwen3's template does not render (system, user, assistant, tool)");
    }
  }
}

// Mistral's [INST] templates: after an optional system message, users and assistants alternate.
void check_mistral_roles(const std::vector<ChatMessage>& messages, bool system_allowed) {
  const size_t first = !messages.empty() && messages.front().role == "system" && system_allowed ? 1 : 0;
  for (size_t index = first; index < messages.size(); ++index) {
    const std::string expected = (index - first) % 2 == 0 ? "user" : "assistant";
    if (messages[index].role != expected) {
      throw Error(ErrorCode::kTokenizer, "chat message " + std::to_string(index) + " has role '" + messages[index].role +
                  "' where Mistral's template needs '" + expected + "': " +
                  (system_allowed ? "after an optional system message, " : "without a system message, ") +
                  "user and assistant turns alternate");
    }
  }
}

void render_mistral_v1(const std::vector<ChatMessage>& messages, const std::string& bos_token,
                       const std::string& eos_token, SegmentWriter& out) {
  check_mistral_roles(messages, /*system_allowed=*/false);
  out.add(bos_token, false);
  for (const ChatMessage& message : messages) {
    if (message.role == "user") {
      out.add("[INST] " + message.content + " [/INST]", false);
    } else {
      out.add(message.content + eos_token, true);
    }
  }
}

void render_mistral_v3(const std::vector<ChatMessage>& messages, const std::string& bos_token,
                       const std::string& eos_token, SegmentWriter& out) {
  check_mistral_roles(messages, /*system_allowed=*/true);
  const bool has_system = !messages.empty() && messages.front().role == "system";
  size_t last_user = messages.size();
  for (size_t index = 0; index < messages.size(); ++index) {
    if (messages[index].role == "user") last_user = index;
  }
  out.add(bos_token, false);
  for (size_t index = has_system ? 1 : 0; index < messages.size(); ++index) {
    const ChatMessage& message = messages[index];
    if (message.role == "user") {
      const std::string system = has_system && index == last_user ? messages.front().content + "\n\n" : "";
      out.add("[INST] " + system + message.content + "[/INST]", false);
    } else {
      out.add(" " + utf8::strip_python_space(message.content) + eos_token, true);
    }
  }
}

// Gemma's templates: users on even turns, the assistant (named "model") or any other role on odd
// ones; each turn's content trimmed as Jinja's trim does. Gemma 1 / 2 -it refuse a system message;
// Gemma 3 -it takes a first one as a prefix of the first turn's text (CONTENT + "\n\n", untrimmed).
void render_gemma(const std::vector<ChatMessage>& messages, const std::string& bos_token, bool system_prefix,
                  SegmentWriter& out) {
  const bool has_system = !messages.empty() && messages.front().role == "system";
  if (has_system && !system_prefix) {
    throw Error(ErrorCode::kTokenizer, "chat message 0 is a system message: Gemma's template has no system role (it raises "
                "'System role not supported'); fold the instructions into the first user turn");
  }
  const std::string prefix = has_system ? messages.front().content + "\n\n" : "";
  const size_t first = has_system ? 1 : 0;
  out.add(bos_token, false);
  for (size_t index = first; index < messages.size(); ++index) {
    const ChatMessage& message = messages[index];
    if ((message.role == "user") != ((index - first) % 2 == 0)) {
      throw Error(ErrorCode::kTokenizer, "chat message " + std::to_string(index) + " has role '" + message.role +
                  "': Gemma's template needs user and assistant turns to alternate, starting with the user");
    }
    const bool assistant = message.role == "assistant";
    out.add("<start_of_turn>" + (assistant ? std::string("model") : message.role) + "\n" + (index == first ? prefix : ""),
            false);
    out.add(utf8::strip_python_space(message.content) + "<end_of_turn>", assistant);
    out.add("\n", false);
  }
}

// Phi-3 / Phi-3.5-mini's template: system, user and assistant turns as <|ROLE|>\nCONTENT<|end|>\n
// (other roles render nothing, as the template's if-chain has no branch for them); Phi-3.5's skips a
// system message with empty content. Without a generation prompt the text ends with eos_token.
void render_phi3(const std::vector<ChatMessage>& messages, bool skip_empty_system, const std::string& eos_token,
                 bool add_generation_prompt, SegmentWriter& out) {
  for (const ChatMessage& message : messages) {
    if (message.role != "system" && message.role != "user" && message.role != "assistant") continue;
    if (message.role == "system" && skip_empty_system && message.content.empty()) continue;
    const bool assistant = message.role == "assistant";
    out.add("<|" + message.role + "|>\n", false);
    out.add(message.content + "<|end|>", assistant);
    out.add("\n", false);
  }
  if (!add_generation_prompt) out.add(eos_token, false);
}

// Phi-4-mini's: every message as <|ROLE|>CONTENT<|end|>, no newlines (a system message's tools are
// not part of ChatMessage: the template's tools branch never applies). Ends as Phi-3's.
void render_phi4_mini(const std::vector<ChatMessage>& messages, const std::string& eos_token,
                      bool add_generation_prompt, SegmentWriter& out) {
  for (const ChatMessage& message : messages) {
    const bool assistant = message.role == "assistant";
    out.add("<|" + message.role + "|>", false);
    out.add(message.content + "<|end|>", assistant);
  }
  if (!add_generation_prompt) out.add(eos_token, false);
}

}  // namespace

const std::vector<std::pair<ChatTemplate::Family, const char*>>& ChatTemplate::family_names() {
  static const std::vector<std::pair<Family, const char*>> names = {
      {Family::kLlama3, "llama3"},         {Family::kChatml, "chatml"},
      {Family::kQwen3, "qwen3"},           {Family::kQwen3Instruct, "qwen3-instruct"},
      {Family::kQwen3Thinking, "qwen3-thinking"}, {Family::kMistralV1, "mistral-v1"},
      {Family::kMistralV3, "mistral-v3"},     {Family::kGemma, "gemma"},
      {Family::kGemma3, "gemma3"},            {Family::kPhi3, "phi3"},                {Family::kPhi35, "phi3.5"},
      {Family::kPhi4Mini, "phi4-mini"},
  };
  return names;
}

std::vector<std::string> ChatTemplate::supported_families() {
  std::vector<std::string> names;
  for (const auto& [family, name] : family_names()) names.emplace_back(name);
  return names;
}

namespace {
std::string supported_list() {
  std::string list;
  for (const auto& name : ChatTemplate::supported_families()) list += (list.empty() ? "" : ", ") + name;
  return list;
}
}  // namespace

ChatTemplate ChatTemplate::named(const std::string& family, const std::string& bos_token, const std::string& eos_token) {
  for (const auto& [member, name] : family_names()) {
    if (family == name) return ChatTemplate(member, bos_token, eos_token);
  }
  throw Error(ErrorCode::kTokenizer, "data.chat_template: unknown chat template family '" + family + "' (supported: " + supported_list() +
              ")");
}

ChatTemplate ChatTemplate::from_template_text(const std::string& text, const std::string& source,
                                              const std::string& bos_token, const std::string& eos_token) {
  const std::string force_hint = "; set data.chat_template to one of " + supported_list() +
                                 " to train with that format instead";
  if (contains(text, "<|start_header_id|>") && contains(text, "<|end_header_id|>") && contains(text, "<|eot_id|>")) {
    if (contains(text, "Cutting Knowledge Date")) {
      throw Error(ErrorCode::kTokenizer, source + ": this Llama 3.1+ chat template adds a dated system header ('Cutting Knowledge Date') "
                  "that qtrain's llama3 family does not render" + force_hint);
    }
    return ChatTemplate(Family::kLlama3, bos_token, eos_token);
  }
  if (contains(text, "<|im_start|>") && contains(text, "<|im_end|>")) {
    if (contains(text, "<think>")) {
      // Qwen3's three templates share their turns; they differ in when a think block is written.
      const bool qwen3_turns = contains(text, "last_query_index") && contains(text, "reasoning_content") &&
                               contains(text, "<tool_response>") && !contains(text, "|trim") && !contains(text, "image");
      if (qwen3_turns && contains(text, "enable_thinking") && contains(text, "loop.last or (not loop.last and reasoning_content)")) {
        return ChatTemplate(Family::kQwen3, bos_token, eos_token);
      }
      if (qwen3_turns && !contains(text, "enable_thinking") && contains_literal(text, "'<|im_start|>assistant\\n<think>\\n'")) {
        return ChatTemplate(Family::kQwen3Thinking, bos_token, eos_token);
      }
      if (qwen3_turns && !contains(text, "enable_thinking") && !contains(text, "loop.last or (not loop.last")) {
        return ChatTemplate(Family::kQwen3Instruct, bos_token, eos_token);
      }
      throw Error(ErrorCode::kTokenizer, source + ": this chatml template renders reasoning blocks (<think>) differently from "
                  "Qwen3's templates (hybrid, Instruct-2507, Thinking-2507), the ones qtrain renders" + force_hint);
    }
    ChatTemplate chatml(Family::kChatml, bos_token, eos_token, chatml_default_system_prompt(text));
    chatml.tool_responses_ = contains(text, "<tool_response>");
    return chatml;
  }
  if (contains(text, "[INST]") && contains(text, "[/INST]")) {
    if (contains(text, "'[INST] ' + message['content'] + ' [/INST]'") && contains(text, "message['content'] + eos_token") &&
        !contains(text, "system")) {
      return ChatTemplate(Family::kMistralV1, bos_token, eos_token);
    }
    if (contains(text, "\"[INST] \" + message[\"content\"] + \"[/INST]\"") &&
        contains(text, "(message == user_messages[-1]) and system_message is defined") &&
        contains(text, "\" \" + message[\"content\"]|trim + eos_token")) {
      return ChatTemplate(Family::kMistralV3, bos_token, eos_token);
    }
    throw Error(ErrorCode::kTokenizer, source + ": this [INST] template is not one of Mistral's that qtrain renders (7B v0.1 / "
                "v0.2: mistral-v1; v0.3: mistral-v3)" + force_hint);
  }
  if (contains(text, "<start_of_turn>") && contains(text, "<end_of_turn>")) {
    if (contains(text, "first_user_prefix") && contains_literal(text, "messages[0]['content'] + '\\n\\n'") &&
        contains(text, "(first_user_prefix if loop.first else \"\")") && contains(text, "{%- set role = \"model\" -%}") &&
        contains(text, "message['content'] | trim")) {
      return ChatTemplate(Family::kGemma3, bos_token, eos_token);
    }
    if (contains(text, "raise_exception('System role not supported')") && contains(text, "{% set role = 'model' %}") &&
        contains(text, "message['content'] | trim + '<end_of_turn>") && !contains(text, "image")) {
      return ChatTemplate(Family::kGemma, bos_token, eos_token);
    }
    throw Error(ErrorCode::kTokenizer, source + ": this <start_of_turn> template is not Gemma's that qtrain renders (Gemma 1 / "
                "2 -it: gemma; Gemma 3 -it: gemma3)" + force_hint);
  }
  if (contains(text, "<|end|>") && contains(text, "add_generation_prompt") && contains(text, "eos_token") &&
      !contains(text, "bos_token")) {
    const bool turns_with_newlines = contains_literal(text, "'<|user|>\\n' + message['content'] + '<|end|>\\n'") &&
                                     contains_literal(text, "'<|assistant|>\\n' + message['content'] + '<|end|>\\n'") &&
                                     contains_literal(text, "{{ '<|assistant|>\\n' }}");
    if (turns_with_newlines && contains(text, "message['role'] == 'system' and message['content'] %}")) {
      return ChatTemplate(Family::kPhi35, bos_token, eos_token);
    }
    if (turns_with_newlines && contains(text, "message['role'] == 'system' %}")) {
      return ChatTemplate(Family::kPhi3, bos_token, eos_token);
    }
    if (contains(text, "'<|' + message['role'] + '|>' + message['content'] + '<|end|>'") &&
        contains(text, "{{ '<|assistant|>' }}")) {
      return ChatTemplate(Family::kPhi4Mini, bos_token, eos_token);
    }
    throw Error(ErrorCode::kTokenizer, source + ": this <|end|> template is not one of Phi's that qtrain renders (Phi-3-mini: "
                "phi3; Phi-3.5-mini: phi3.5; Phi-4-mini: phi4-mini)" + force_hint);
  }
  throw Error(ErrorCode::kTokenizer, source + ": the chat template is not one qtrain recognises (supported families: " + supported_list() +
              "; qtrain renders templates without a Jinja engine)" + force_hint);
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& model_dir, const std::string& forced_family) {
  const TokenizerConfig config = TokenizerConfig::read_from_model_dir(model_dir);
  const std::string bos_token = config.bos_token.value_or(""), eos_token = config.eos_token.value_or("");
  if (!forced_family.empty()) return named(forced_family, bos_token, eos_token);
  const std::string jinja_path = model_dir + "/chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) {
    return from_template_text(read_text_file(jinja_path, "a Jinja chat template"), jinja_path, bos_token, eos_token);
  }
  if (config.chat_template) {
    return from_template_text(*config.chat_template, model_dir + "/tokenizer_config.json: chat_template", bos_token, eos_token);
  }
  throw Error(ErrorCode::kTokenizer, model_dir + ": no chat template (neither chat_template.jinja nor a \"chat_template\" in "
              "tokenizer_config.json); set data.chat_template to one of " + supported_list());
}

std::string ChatTemplate::family() const {
  for (const auto& [member, name] : family_names()) {
    if (member == family_) return name;
  }
  throw Error(ErrorCode::kInternal, "ChatTemplate: a family without a name");
}

std::vector<ChatSegment> ChatTemplate::render_segments(const std::vector<ChatMessage>& messages,
                                                       bool add_generation_prompt) const {
  check_roles(messages);
  SegmentWriter out;
  std::string generation_prompt = "<|im_start|>assistant\n";
  switch (family_) {
    case Family::kLlama3:
      render_llama3(messages, bos_token_, out);
      generation_prompt = "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case Family::kChatml:
      render_chatml(messages, default_system_prompt_, tool_responses_, out);
      break;
    case Family::kQwen3:
    case Family::kQwen3Instruct:
      render_qwen3(messages, /*think_on_last_turn=*/family_ == Family::kQwen3, out);
      break;
    case Family::kQwen3Thinking:
      render_qwen3(messages, /*think_on_last_turn=*/true, out);
      generation_prompt += "<think>\n";
      break;
    case Family::kMistralV1:
    case Family::kMistralV3:
      // The next turn starts with the user's [INST]: there is no assistant header to add.
      (family_ == Family::kMistralV1 ? render_mistral_v1 : render_mistral_v3)(messages, bos_token_, eos_token_, out);
      generation_prompt.clear();
      break;
    case Family::kGemma:
    case Family::kGemma3:
      render_gemma(messages, bos_token_, /*system_prefix=*/family_ == Family::kGemma3, out);
      generation_prompt = "<start_of_turn>model\n";
      break;
    case Family::kPhi3:
    case Family::kPhi35:
      render_phi3(messages, /*skip_empty_system=*/family_ == Family::kPhi35, eos_token_, add_generation_prompt, out);
      generation_prompt = "<|assistant|>\n";
      break;
    case Family::kPhi4Mini:
      render_phi4_mini(messages, eos_token_, add_generation_prompt, out);
      generation_prompt = "<|assistant|>";
      break;
  }
  if (add_generation_prompt) out.add(generation_prompt, false);
  return out.take();
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string text;
  for (const ChatSegment& segment : render_segments(messages, add_generation_prompt)) text += segment.text;
  return text;
}

}  // namespace qtrain::data
