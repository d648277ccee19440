#include "data/sample_formats.h"

#include <algorithm>
#include <array>

#include "kernels/error.h"

namespace qtrain::data {

namespace {

const std::array<const char*, 5> kChatRoles = {"system", "user", "assistant", "tool", "ipython"};

// ShareGPT's speaker names, as axolotl maps them.
std::string sharegpt_role(const std::string& from) {
  if (from == "human") return "user";
  if (from == "gpt") return "assistant";
  return from;
}

std::string optional_string_field(const JsonlRecord& record, const std::string& key) {
  const auto found = record.value.find(key);
  if (found == record.value.end() || found->is_null()) return "";
  if (!found->is_string()) record.fail("field \"" + key + "\" must be a string");
  return found->get<std::string>();
}

}  // namespace

SampleBuilder::SampleBuilder(const SampleFormatOptions& options, Tokenizer tokenizer, const std::string& model_dir)
    : options_(options), tokenizer_(std::move(tokenizer)) {
  if (options_.format == "instruct") {
    prompt_template_ = PromptTemplate::named_or_custom(options_.prompt_template);
  } else if (options_.format == "chat") {
    chat_template_ = ChatTemplate::from_model_dir(model_dir, options_.chat_template);
  } else if (options_.format != "text") {
    throw Error(ErrorCode::kData, "data.format '" + options_.format + "' has no record format (expected text, instruct or chat)");
  }
}

void SampleBuilder::append(Example& sample, const std::string& text, bool learned, bool add_special_tokens) const {
  const auto ids = tokenizer_.encode(text, add_special_tokens);
  sample.input_ids.insert(sample.input_ids.end(), ids.begin(), ids.end());
  if (learned) {
    sample.labels.insert(sample.labels.end(), ids.begin(), ids.end());
  } else {
    sample.labels.insert(sample.labels.end(), ids.size(), kIgnoreLabel);
  }
}

void SampleBuilder::append_eos(Example& sample, bool learned, const JsonlRecord* record) const {
  const auto eos = tokenizer_.eos_id();
  if (!eos) {
    if (record == nullptr) return;  // plain text: documents simply end
    record->fail("the tokenizer has no eos_token (tokenizer_config.json), so the model cannot learn where a "
                 "response ends; add one to tokenizer_config.json");
  }
  sample.input_ids.push_back(*eos);
  sample.labels.push_back(learned ? *eos : kIgnoreLabel);
}

Example SampleBuilder::from_text(const std::string& text) const {
  Example sample;
  append(sample, text, /*learned=*/true, /*add_special_tokens=*/true);
  append_eos(sample, /*learned=*/true, nullptr);
  return sample;
}

Example SampleBuilder::from_record(const JsonlRecord& record) const {
  if (record.value.contains("input_ids")) return from_token_ids(record);
  if (options_.format == "instruct") return from_instruct(record);
  if (options_.format == "chat") return from_chat(record);
  if (!record.value.contains(options_.text_field)) {
    record.fail("missing the field \"" + options_.text_field + "\" (data.text_field)");
  }
  return from_text(record.string_field(options_.text_field));
}

Example SampleBuilder::from_token_ids(const JsonlRecord& record) const {
  const int64_t vocab_size = tokenizer_.vocab_size();
  const auto read_ids = [&](const char* key, bool allow_ignore) {
    const auto& list = record.value.at(key);
    if (!list.is_array()) record.fail(std::string("\"") + key + "\" must be a list of token ids");
    std::vector<int64_t> ids;
    for (const auto& id : list) {
      const bool valid = id.is_number_integer() &&
                         ((id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab_size) ||
                          (allow_ignore && id.get<int64_t>() == kIgnoreLabel));
      if (!valid) {
        record.fail(std::string("\"") + key + "\" holds " + id.dump() + ", expected token ids in [0, " +
                    std::to_string(vocab_size) + ")" + (allow_ignore ? " or -100" : ""));
      }
      ids.push_back(id.get<int64_t>());
    }
    return ids;
  };
  Example sample;
  sample.input_ids = read_ids("input_ids", false);
  sample.labels = record.value.contains("labels") ? read_ids("labels", true) : sample.input_ids;
  if (sample.labels.size() != sample.input_ids.size()) {
    record.fail("\"labels\" has " + std::to_string(sample.labels.size()) + " entries for " +
                std::to_string(sample.input_ids.size()) + " \"input_ids\"");
  }
  return sample;
}

Example SampleBuilder::from_instruct(const JsonlRecord& record) const {
  const std::string instruction = record.string_field("instruction");
  const std::string input = optional_string_field(record, "input");
  const std::string output = record.string_field("output");
  if (!input.empty() && !prompt_template_->takes_input()) {
    record.fail("the record has an \"input\" but data.prompt_template has no {input} placeholder");
  }
  Example sample;
  append(sample, prompt_template_->render(instruction, input), options_.train_on_inputs, /*add_special_tokens=*/true);
  append(sample, output, /*learned=*/true, /*add_special_tokens=*/false);
  append_eos(sample, /*learned=*/true, &record);
  return sample;
}

std::vector<ChatMessage> read_chat_messages(const JsonlRecord& record) {
  const bool sharegpt = !record.value.contains("messages") && record.value.contains("conversations");
  const char* list_key = sharegpt ? "conversations" : "messages";
  const char* role_key = sharegpt ? "from" : "role";
  const char* content_key = sharegpt ? "value" : "content";
  const auto list = record.value.find(list_key);
  if (list == record.value.end()) record.fail("missing the field \"messages\" (a list of {\"role\", \"content\"})");
  if (!list->is_array() || list->empty()) {
    record.fail(std::string("\"") + list_key + "\" must be a non-empty list of messages");
  }
  std::vector<ChatMessage> messages;
  for (size_t index = 0; index < list->size(); ++index) {
    const auto& message = (*list)[index];
    const std::string where = std::string(list_key) + "[" + std::to_string(index) + "]";
    if (!message.is_object() || !message.contains(role_key) || !message[role_key].is_string() ||
        !message.contains(content_key) || !message[content_key].is_string()) {
      record.fail(where + " must be an object with string fields \"" + role_key + "\" and \"" + content_key + "\"");
    }
    std::string role = message[role_key].get<std::string>();
    if (sharegpt) role = sharegpt_role(role);
    if (std::find(kChatRoles.begin(), kChatRoles.end(), role) == kChatRoles.end()) {
      record.fail(where + " has the role '" + message[role_key].get<std::string>() +
                  "'; expected system, user, assistant, tool or ipython" +
                  (sharegpt ? " (ShareGPT: human, gpt, system)" : ""));
    }
    ChatMessage chat_message{role, message[content_key].get<std::string>()};
    if (const auto reasoning = message.find("reasoning_content"); reasoning != message.end() && !reasoning->is_null()) {
      if (!reasoning->is_string()) record.fail(where + ": \"reasoning_content\" must be a string");
      chat_message.reasoning_content = reasoning->get<std::string>();
    }
    messages.push_back(std::move(chat_message));
  }
  return messages;
}

Example SampleBuilder::from_chat(const JsonlRecord& record) const {
  const auto messages = read_chat_messages(record);
  if (std::none_of(messages.begin(), messages.end(), [](const ChatMessage& m) { return m.role == "assistant"; })) {
    record.fail("the chat has no assistant message, so nothing in it would be learned");
  }
  Example sample;
  for (const auto& segment : chat_template_->render_segments(messages, /*add_generation_prompt=*/false)) {
    append(sample, segment.text, segment.trainable || options_.train_on_inputs, /*add_special_tokens=*/false);
  }
  return sample;
}

}  // namespace qtrain::data
