// Chat templates against transformers' apply_chat_template (../shared/fixtures and renders
// of the templates below made with transformers 5.17).
#include "data/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "kernels/error.h"
#include "support.h"

namespace qtrain::data {
namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream input(path);
  return nlohmann::json::parse(input);
}

std::vector<ChatMessage> messages_of(const nlohmann::json& list) {
  std::vector<ChatMessage> messages;
  for (const auto& message : list) messages.push_back({message["role"], message["content"]});
  return messages;
}

const nlohmann::json& reference() {
  static const nlohmann::json value = read_json(qtrain::testing::fixture("chat-template-reference.json"));
  return value;
}

const std::string kChatmlTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
const std::string kQwen2Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}";

const std::vector<ChatMessage> kConversation = {
    {"system", "You are terse."}, {"user", " Name a colour. "}, {"assistant", "Blue."}};

TEST(ChatTemplate, TinyLlamaTemplateIsLlama3) {
  EXPECT_EQ(ChatTemplate::from_model_dir(qtrain::testing::fixture("tiny-llama")).family(), "llama3");
}

TEST(ChatTemplate, Llama3RenderEqualsTransformers) {
  const ChatTemplate chat_template = ChatTemplate::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  EXPECT_EQ(chat_template.render(messages_of(reference()["messages"]), /*add_generation_prompt=*/false),
            reference()["text"].get<std::string>());
}

TEST(ChatTemplate, Llama3RenderedIdsEqualTransformers) {
  const ChatTemplate chat_template = ChatTemplate::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  const Tokenizer tokenizer = Tokenizer::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  const std::string text = chat_template.render(messages_of(reference()["messages"]), false);
  // The rendered text starts with the BOS text already, so no second BOS is added.
  EXPECT_EQ(tokenizer.encode(text, /*add_special_tokens=*/false), reference()["ids"].get<std::vector<int64_t>>());
}

TEST(ChatTemplate, Llama3TrimsContentAndAddsGenerationPrompt) {
  const ChatTemplate chat_template = ChatTemplate::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  EXPECT_EQ(chat_template.render({kConversation[1]}, /*add_generation_prompt=*/true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, ChatmlRenderEqualsTransformers) {
  const ChatTemplate chat_template = ChatTemplate::from_template_text(kChatmlTemplate, "test template", "<s>");
  EXPECT_EQ(chat_template.family(), "chatml");
  EXPECT_EQ(chat_template.render(kConversation, false),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n Name a colour. <|im_end|>\n"
            "<|im_start|>assistant\nBlue.<|im_end|>\n");
  EXPECT_EQ(chat_template.render({kConversation[1]}, /*add_generation_prompt=*/true),
            "<|im_start|>user\n Name a colour. <|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, ChatmlDefaultSystemPromptEqualsTransformers) {
  qtrain::testing::TempDir model_dir;
  model_dir.write("tokenizer_config.json", nlohmann::json{{"chat_template", kQwen2Template}}.dump());
  const ChatTemplate chat_template = ChatTemplate::from_model_dir(model_dir.path());
  EXPECT_EQ(chat_template.render({kConversation[1], kConversation[2]}, false),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n Name a colour. "
            "<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n");
  EXPECT_EQ(chat_template.render(kConversation, false),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n Name a colour. <|im_end|>\n"
            "<|im_start|>assistant\nBlue.<|im_end|>\n");
}

TEST(ChatTemplate, OnlyAssistantContentAndEndOfTurnAreTrainable) {
  const ChatTemplate llama3 = ChatTemplate::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  const auto messages = messages_of(reference()["messages"]);
  const auto segments = llama3.render_segments(messages, false);
  std::string joined, trainable;
  for (const ChatSegment& segment : segments) {
    joined += segment.text;
    if (segment.trainable) trainable += segment.text;
  }
  EXPECT_EQ(joined, reference()["text"].get<std::string>());
  EXPECT_EQ(trainable, "Blue.<|eot_id|>");

  const auto chatml_segments = ChatTemplate::named("chatml").render_segments(kConversation, false);
  trainable.clear();
  for (const ChatSegment& segment : chatml_segments) {
    if (segment.trainable) trainable += segment.text;
  }
  EXPECT_EQ(trainable, "Blue.<|im_end|>");
}

TEST(ChatTemplate, UnknownTemplateIsAnErrorNamingFileAndFamilies) {
  qtrain::testing::TempDir model_dir;
  model_dir.write("chat_template.jinja",
             "{{ bos_token }}{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}");
  try {
    ChatTemplate::from_model_dir(model_dir.path());
    FAIL() << "expected qtrain::Error";
  } catch (const qtrain::Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(model_dir.path() + "/chat_template.jinja"), std::string::npos) << message;
    EXPECT_NE(message.find("llama3"), std::string::npos) << message;
    EXPECT_NE(message.find("chatml"), std::string::npos) << message;
    EXPECT_NE(message.find("data.chat_template"), std::string::npos) << message;
  }
  // Forcing a family skips detection.
  EXPECT_EQ(ChatTemplate::from_model_dir(model_dir.path(), "chatml").family(), "chatml");
}

TEST(ChatTemplate, UnknownFamilyNameIsAnError) {
  EXPECT_THROW(ChatTemplate::named("mistral"), qtrain::Error);
}

}  // namespace
}  // namespace qtrain::data
