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
#include "json_support.h"

namespace qtrain::data {
namespace {

using testing::read_json;
std::vector<ChatMessage> messages_of(const nlohmann::json& list) {
  std::vector<ChatMessage> messages;
  for (const auto& message : list) messages.push_back({message["role"], message["content"]});
  return messages;
}

const nlohmann::json& template_reference() {
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
  EXPECT_EQ(chat_template.render(messages_of(template_reference()["messages"]), /*add_generation_prompt=*/false),
            template_reference()["text"].get<std::string>());
}

TEST(ChatTemplate, Llama3RenderedIdsEqualTransformers) {
  const ChatTemplate chat_template = ChatTemplate::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  const Tokenizer tokenizer = Tokenizer::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  const std::string text = chat_template.render(messages_of(template_reference()["messages"]), false);
  // The rendered text starts with the BOS text already, so no second BOS is added.
  EXPECT_EQ(tokenizer.encode(text, /*add_special_tokens=*/false), template_reference()["ids"].get<std::vector<int64_t>>());
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
  const auto messages = messages_of(template_reference()["messages"]);
  const auto segments = llama3.render_segments(messages, false);
  std::string joined, trainable;
  for (const ChatSegment& segment : segments) {
    joined += segment.text;
    if (segment.trainable) trainable += segment.text;
  }
  EXPECT_EQ(joined, template_reference()["text"].get<std::string>());
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

// Qwen2.5's template turns tool results into <tool_response> user turns; the chatml family
// would render "<|im_start|>tool", so a tool message is refused rather than rendered otherwise.
TEST(ChatTemplate, ChatmlWithToolResponsesRefusesToolMessages) {
  const ChatTemplate qwen25 = ChatTemplate::from_template_text(
      kQwen2Template + "{% if message.role == 'tool' %}{{ '<tool_response>' }}{% endif %}", "qwen2.5", "");
  EXPECT_EQ(qwen25.family(), "chatml");
  EXPECT_NO_THROW(qwen25.render(kConversation, false));
  try {
    qwen25.render({{"user", "Weather?"}, {"assistant", "Calling."}, {"tool", "21"}, {"assistant", "21."}}, false);
    FAIL() << "expected an error";
  } catch (const qtrain::Error& error) {
    EXPECT_NE(std::string(error.what()).find("chat message 2"), std::string::npos) << error.what();
  }
  // A plain chatml template renders the role as it is.
  EXPECT_NE(ChatTemplate::named("chatml").render({{"tool", "21"}}, false).find("<|im_start|>tool\n21"), std::string::npos);
}

TEST(ChatTemplate, UnknownFamilyNameIsAnError) {
  EXPECT_THROW(ChatTemplate::named("vicuna"), qtrain::Error);
  for (const auto& family : ChatTemplate::supported_families()) EXPECT_EQ(ChatTemplate::named(family).family(), family);
}

// Released models' templates (tests/data/chat_templates): each is recognised as its family and
// renders, over conversations that reach each branch of the template, the text and ids that
// transformers' apply_chat_template renders from the same template text.
struct ReleasedTemplate {
  std::string file;
  std::string family;
};
std::ostream& operator<<(std::ostream& out, const ReleasedTemplate& value) { return out << value.file; }

struct ChatCase {
  std::vector<ChatMessage> messages;
  bool add_generation_prompt;
};

std::vector<ChatCase> cases_for(const std::string& family) {
  const std::vector<ChatMessage> system_first = {
      {"system", "You are terse."}, {"user", " Name a colour. "}, {"assistant", "  Blue.\n"}};
  const std::vector<ChatMessage> two_turns = {{"user", "What is 2+2?"},
                                              {"assistant", "<think>\nAdd them.\n</think>\n\n4"},
                                              {"user", "And 3+3?"},
                                              {"assistant", "<think>\n\nThree and three.\n\n</think>\n\n\n6"}};
  const std::vector<ChatMessage> ends_with_user = {{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}};
  std::vector<ChatCase> cases = {{system_first, false}, {two_turns, false}, {ends_with_user, true}, {system_first, true}};
  if (family.rfind("qwen3", 0) == 0) {
    // Tool output arrives as user turns of <tool_response> blocks; the query is the earlier user turn.
    cases.push_back({{{"user", "Weather in Paris?"},
                      {"assistant", "<think>Call the tool.</think>Checking."},
                      {"tool", "{\"temp\": 21}"},
                      {"tool", "{\"sky\": \"clear\"}"},
                      {"assistant", "21 and clear."}},
                     false});
    cases.push_back({{{"user", "Plain?"}, {"assistant", "No reasoning here."}}, false});
    // Reasoning given apart from the content wins over a think block inside it.
    cases.push_back({{{"user", "Why?"}, {"assistant", "<think>ignored</think>Because.", "\nGiven apart.\n"}}, false});
    cases.push_back({{{"system", "S"}, {"user", "a"}, {"assistant", "b"}, {"system", "late system"}, {"user", "c"}}, true});
  } else if (family == "gemma3") {
    // The system message opens the first turn, untrimmed; an odd turn of another role keeps its name.
    cases.push_back({{{"system", "  Be brief. "}, {"user", " One"}, {"assistant", " 1 "}, {"tool", "{}"}}, false});
    cases.push_back({{{"system", "Alone"}}, true});
    cases.push_back({{{"system", "S"}, {"assistant", "a"}}, false});  // not alternating: both refuse
  } else if (family == "gemma") {
    // No system role; an odd turn of another role renders under its own name.
    cases.push_back({{{"user", "One"}, {"assistant", " 1 "}, {"user", "Two"}, {"assistant", "\t2\n"}}, false});
    cases.push_back({{{"user", "a"}, {"user", "b"}}, false});  // not alternating: both refuse
  } else if (family.rfind("phi", 0) == 0) {
    // An empty system message (Phi-3.5 drops it), a role the template has no branch for (Phi-3
    // renders nothing of it, Phi-4-mini its <|tool|> turn), turns in any order.
    cases.push_back({{{"system", ""}, {"user", "One"}, {"assistant", "1"}, {"tool", "{\"x\": 1}"}, {"assistant", "2"}}, false});
    cases.push_back({{{"user", "a"}, {"user", "b"}}, true});
  } else {
    cases.push_back({{{"system", "Be brief."}, {"user", "One"}, {"assistant", "1"}, {"user", "Two"}, {"assistant", "2"}}, false});
    cases.push_back({{{"user", "a"}, {"user", "b"}}, false});  // not alternating: both refuse
  }
  return cases;
}

class ReleasedChatTemplate : public ::testing::TestWithParam<ReleasedTemplate> {};

TEST_P(ReleasedChatTemplate, RendersTheTextAndIdsTransformersRenders) {
  const std::string template_path = qtrain::testing::source_dir() + "/tests/data/chat_templates/" + GetParam().file;
  const std::string tokenizer_dir = qtrain::testing::fixture("tiny-llama");
  const auto config_bos = "<|begin_of_text|>", config_eos = "<|eot_id|>";  // tiny-llama's tokenizer_config.json
  const ChatTemplate chat_template =
      ChatTemplate::from_template_text(qtrain::testing::read_text(template_path), template_path, config_bos, config_eos);
  ASSERT_EQ(chat_template.family(), GetParam().family);

  const auto python = qtrain::testing::find_python_with("transformers jinja2");
  if (python.empty()) GTEST_SKIP() << "no Python with transformers (set QTRAIN_PYTHON)";
  const auto cases = cases_for(GetParam().family);
  nlohmann::json request = {{"template", template_path}, {"cases", nlohmann::json::array()}};
  for (const auto& chat_case : cases) {
    nlohmann::json messages = nlohmann::json::array();
    for (const auto& message : chat_case.messages) {
      nlohmann::json entry = {{"role", message.role}, {"content", message.content}};
      if (message.reasoning_content) entry["reasoning_content"] = *message.reasoning_content;
      messages.push_back(entry);
    }
    request["cases"].push_back({{"messages", messages}, {"add_generation_prompt", chat_case.add_generation_prompt}});
  }
  qtrain::testing::TempDir temp;
  temp.write("request.json", request.dump());
  const std::string command = "'" + python + "' '" + qtrain::testing::source_dir() + "/tests/interop/render_chat_template.py' '" +
                              tokenizer_dir + "' '" + temp.file("request.json") + "' '" + temp.file("rendered.json") + "' 2>&1";
  const auto result = qtrain::testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  const auto rendered = read_json(temp.file("rendered.json"));
  const Tokenizer tokenizer = Tokenizer::from_model_dir(tokenizer_dir);
  for (size_t index = 0; index < cases.size(); ++index) {
    const auto& want = rendered["texts"][index];
    SCOPED_TRACE("case " + std::to_string(index));
    if (want.is_null()) {
      EXPECT_THROW(chat_template.render(cases[index].messages, cases[index].add_generation_prompt), qtrain::Error);
      continue;
    }
    const auto segments = chat_template.render_segments(cases[index].messages, cases[index].add_generation_prompt);
    std::string text, trainable;
    for (const auto& segment : segments) {
      text += segment.text;
      if (segment.trainable) trainable += segment.text;
    }
    EXPECT_EQ(text, want.get<std::string>());
    EXPECT_EQ(tokenizer.encode(text, /*add_special_tokens=*/false), rendered["ids"][index].get<std::vector<int64_t>>());
    // What is learned is what the assistant says: its last answer, never a user's words.
    for (const auto& message : cases[index].messages) {
      if (message.role == "user") EXPECT_EQ(trainable.find(message.content), std::string::npos) << message.content;
    }
    if (cases[index].messages.back().role == "assistant") EXPECT_FALSE(trainable.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ReleasedChatTemplate,
                         ::testing::Values(ReleasedTemplate{"qwen3.jinja", "qwen3"},
                                           ReleasedTemplate{"qwen3-instruct-2507.jinja", "qwen3-instruct"},
                                           ReleasedTemplate{"qwen3-thinking-2507.jinja", "qwen3-thinking"},
                                           ReleasedTemplate{"mistral-7b-v0.1.jinja", "mistral-v1"},
                                           ReleasedTemplate{"mistral-7b-v0.3.jinja", "mistral-v3"},
                                           ReleasedTemplate{"gemma-2.jinja", "gemma"},
                                           ReleasedTemplate{"gemma-3-it.jinja", "gemma3"},
                                           ReleasedTemplate{"phi-3-mini-4k.jinja", "phi3"},
                                           ReleasedTemplate{"phi-3.5-mini.jinja", "phi3.5"},
                                           ReleasedTemplate{"phi-4-mini.jinja", "phi4-mini"}),
                         [](const auto& info) {
                           std::string name = info.param.family;
                           for (auto& character : name) {
                             if (character == '-' || character == '.') character = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace qtrain::data
