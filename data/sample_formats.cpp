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
  } else if (options_.format == "preference") {
    // Pairs of plain strings need no chat template; pairs of messages do.
    try {
      chat_template_ = ChatTemplate::from_model_dir(model_dir, options_.chat_template);
    } catch (const Error& error) {
      missing_chat_template_ = error.what();
    }
  } else if (options_.format != "text") {
    throw Error(ErrorCode::kData, "data.format '" + options_.format +
                "' has no record format (expected text, instruct, chat or preference)");
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
  if (options_.format == "preference") return from_preference(record);
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
  if (options_.format == "preference") {
    const auto lengths = record.value.find("sample_lengths");
    const bool pair = lengths != record.value.end() && lengths->is_array() && lengths->size() == 2 &&
                      (*lengths)[0].is_number_integer() && (*lengths)[1].is_number_integer() &&
                      (*lengths)[0].get<int64_t>() > 0 && (*lengths)[1].get<int64_t>() > 0 &&
                      (*lengths)[0].get<int64_t>() + (*lengths)[1].get<int64_t>() == sample.size();
    if (!pair) {
      record.fail("a tokenised preference pair needs \"sample_lengths\": [chosen, rejected], two positive lengths "
                  "that sum to the " + std::to_string(sample.size()) + " \"input_ids\" (what `qtrain data --json` prints)");
    }
    sample.sample_lengths = {(*lengths)[0].get<int64_t>(), (*lengths)[1].get<int64_t>()};
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

namespace {

// TRL's extract_prompt for a record without "prompt": the prompt is what chosen and rejected
// begin with, up to the first difference (a space before it stays with the completions).
template <typename Sequence, typename Equal, typename IsSpace>
size_t implicit_prompt_length(const Sequence& chosen, const Sequence& rejected, const Equal& equal, const IsSpace& is_space) {
  const size_t shortest = std::min(chosen.size(), rejected.size());
  if (shortest == 0) return 0;
  for (size_t index = 0; index < shortest; ++index) {
    if (equal(chosen[index], rejected[index])) continue;
    return index > 0 && is_space(chosen[index - 1]) ? index - 1 : index;
  }
  return shortest - 1;  // one is the other's beginning: Python's loop variable stops at the last index
}

size_t common_prefix_length(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  size_t length = 0;
  while (length < a.size() && length < b.size() && a[length] == b[length]) ++length;
  return length;
}

bool same_message(const ChatMessage& a, const ChatMessage& b) {
  return a.role == b.role && a.content == b.content && a.reasoning_content == b.reasoning_content;
}

}  // namespace

Example SampleBuilder::from_preference(const JsonlRecord& record) const {
  const auto& value = record.value;
  for (const char* key : {"chosen", "rejected"}) {
    if (!value.contains(key)) record.fail(std::string("missing the field \"") + key + "\" (a preference pair: prompt, chosen, rejected)");
  }
  const bool conversational = value["chosen"].is_array();
  std::vector<int64_t> prompt_ids, chosen_ids, rejected_ids;
  if (conversational) {
    if (!chat_template_) record.fail("the pair is a chat (lists of messages), and " + missing_chat_template_);
    // Each list read as a chat record's messages.
    const auto messages_of = [&](const char* key) {
      if (!value[key].is_array()) record.fail(std::string("\"") + key + "\" must be a list of messages, as \"chosen\" is");
      const nlohmann::json messages = {{"messages", value[key]}};
      return read_chat_messages(JsonlRecord{record.source, record.line, messages});
    };
    std::vector<ChatMessage> prompt;
    auto chosen = messages_of("chosen");
    auto rejected = messages_of("rejected");
    if (value.contains("prompt")) {
      prompt = messages_of("prompt");
    } else {
      const size_t shared =
          implicit_prompt_length(chosen, rejected, same_message, [](const ChatMessage&) { return false; });
      prompt.assign(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(shared));
      chosen.erase(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(shared));
      rejected.erase(rejected.begin(), rejected.begin() + static_cast<std::ptrdiff_t>(shared));
    }
    const auto with_prompt = [&](const std::vector<ChatMessage>& completion) {
      auto messages = prompt;
      messages.insert(messages.end(), completion.begin(), completion.end());
      return tokenizer_.encode(chat_template_->render(messages, /*add_generation_prompt=*/false), false);
    };
    prompt_ids = tokenizer_.encode(chat_template_->render(prompt, /*add_generation_prompt=*/true), false);
    chosen_ids = with_prompt(chosen);
    rejected_ids = with_prompt(rejected);
  } else {
    std::string chosen = record.string_field("chosen");
    std::string rejected = record.string_field("rejected");
    std::string prompt;
    if (value.contains("prompt")) {
      prompt = record.string_field("prompt");
    } else {
      const size_t shared = implicit_prompt_length(
          chosen, rejected, [](char a, char b) { return a == b; }, [](char c) { return c == ' '; });
      prompt = chosen.substr(0, shared);
      chosen.erase(0, shared);
      rejected.erase(0, shared);
    }
    // The text and the EOS token, as TRL appends eos_token to a plain completion.
    const auto with_eos = [&](const std::string& completion) {
      auto ids = tokenizer_.encode(prompt + completion, /*add_special_tokens=*/true);
      const auto eos = tokenizer_.eos_id();
      if (!eos) record.fail("the tokenizer has no eos_token (tokenizer_config.json), so a completion has no end to learn");
      if (ids.empty() || ids.back() != *eos) ids.push_back(*eos);
      return ids;
    };
    prompt_ids = tokenizer_.encode(prompt, /*add_special_tokens=*/true);
    chosen_ids = with_eos(chosen);
    rejected_ids = with_eos(rejected);
  }
  // The prompt is what both sequences begin with of its ids (a token merged across the boundary
  // belongs to the completion).
  const size_t prompt_length = std::min(common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids));
  Example pair;
  for (const auto* sequence : {&chosen_ids, &rejected_ids}) {
    pair.input_ids.insert(pair.input_ids.end(), sequence->begin(), sequence->end());
    pair.labels.insert(pair.labels.end(), prompt_length, kIgnoreLabel);
    pair.labels.insert(pair.labels.end(), sequence->begin() + static_cast<std::ptrdiff_t>(prompt_length), sequence->end());
    pair.sample_lengths.push_back(static_cast<int64_t>(sequence->size()));
  }
  return pair;
}

}  // namespace qtrain::data
