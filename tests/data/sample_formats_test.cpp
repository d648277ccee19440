// Records into labelled samples: what the loss sees is exactly the response (instruct) or the
// assistant turns (chat) plus the end-of-turn token; chat ids equal transformers'
// apply_chat_template + tiny_tokenizer (chat-template-reference.json).
#include "data/sample_formats.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "support.h"

namespace qtrain::data {
namespace {

std::string tiny_model_dir() { return qtrain::testing::fixture("tiny-llama"); }

const Tokenizer& tiny_tokenizer() {
  static const Tokenizer value = Tokenizer::from_model_dir(tiny_model_dir());
  return value;
}

SampleBuilder builder(const std::string& format, bool train_on_inputs = false,
                      const std::string& prompt_template = "alpaca") {
  SampleFormatOptions options;
  options.format = format;
  options.train_on_inputs = train_on_inputs;
  options.prompt_template = prompt_template;
  return SampleBuilder(options, tiny_tokenizer(), tiny_model_dir());
}

Example sample_of(const SampleBuilder& builder, const nlohmann::json& value) {
  const std::string source = "records.jsonl";
  return builder.from_record(JsonlRecord{source, 7, value});
}

// The text of the labels the loss learns from, in order.
std::string learned_text(const Example& sample) {
  std::vector<int64_t> learned;
  for (const int64_t label : sample.labels) {
    if (label != kIgnoreLabel) learned.push_back(label);
  }
  return tiny_tokenizer().decode(learned);
}

std::string all_text(const Example& sample) { return tiny_tokenizer().decode(sample.input_ids); }

TEST(TextSamples, AreBosTextEosAllLearned) {
  const auto sample = sample_of(builder("text"), {{"text", "The jury said."}});
  auto expected = tiny_tokenizer().encode("The jury said.", true);
  expected.push_back(*tiny_tokenizer().eos_id());
  EXPECT_EQ(sample.input_ids, expected);
  EXPECT_EQ(sample.labels, expected);
}

TEST(TextSamples, MissingFieldNamesFileAndLine) {
  try {
    sample_of(builder("text"), {{"body", "x"}});
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("records.jsonl:7"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("\"text\""), std::string::npos) << error.what();
  }
}

TEST(InstructSamples, LabelsAreExactlyTheResponseAndEos) {
  for (const std::string input : {"", "the Brown corpus"}) {
    const auto sample = sample_of(builder("instruct"), {{"instruction", "Summarise this."},
                                                        {"input", input},
                                                        {"output", "A million words of American English."}});
    EXPECT_EQ(learned_text(sample), "A million words of American English.<|eot_id|>");
    const std::string prompt = all_text(sample).substr(0, all_text(sample).find("A million"));
    EXPECT_EQ(prompt.rfind("<|begin_of_text|>Below is an instruction", 0), 0u) << prompt;
    EXPECT_EQ(prompt.find("### Input:") != std::string::npos, !input.empty()) << prompt;
    EXPECT_NE(prompt.find("### Response:\n"), std::string::npos) << prompt;
  }
}

TEST(InstructSamples, TrainOnInputsLearnsEveryTokenAfterTheFirst) {
  const auto sample = sample_of(builder("instruct", true), {{"instruction", "Say hi."}, {"output", "Hi."}});
  EXPECT_EQ(sample.labels, sample.input_ids);
}

TEST(InstructSamples, CustomTemplateFillsBothPlaceholders) {
  const auto sample = sample_of(builder("instruct", false, "Q: {instruction} ({input})\nA: "),
                                {{"instruction", "Two {input}?"}, {"input", "x"}, {"output", "Yes."}});
  EXPECT_EQ(all_text(sample), "<|begin_of_text|>Q: Two {input}? (x)\nA: Yes.<|eot_id|>");
  EXPECT_EQ(learned_text(sample), "Yes.<|eot_id|>");
}

TEST(InstructSamples, MissingOutputAndUnknownTemplateAreErrors) {
  EXPECT_THROW(sample_of(builder("instruct"), {{"instruction", "x"}}), Error);
  EXPECT_THROW(builder("instruct", false, "no placeholder"), Error);
}

nlohmann::json chat_reference() {
  std::ifstream input(qtrain::testing::fixture("chat-template-reference.json"));
  return nlohmann::json::parse(input);
}

TEST(ChatSamples, IdsEqualTransformersAndLabelsAreTheAssistantTurn) {
  const auto reference = chat_reference();
  const auto sample = sample_of(builder("chat"), {{"messages", reference["messages"]}});
  EXPECT_EQ(sample.input_ids, reference["ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(learned_text(sample), "Blue.<|eot_id|>");
}

TEST(ChatSamples, EveryAssistantTurnIsLearnedAndNothingElse) {
  const nlohmann::json messages = {{{"role", "user"}, {"content", "One?"}},
                                   {{"role", "assistant"}, {"content", "Uno."}},
                                   {{"role", "user"}, {"content", "Two?"}},
                                   {{"role", "assistant"}, {"content", "Dos."}}};
  const auto sample = sample_of(builder("chat"), {{"messages", messages}});
  EXPECT_EQ(learned_text(sample), "Uno.<|eot_id|>Dos.<|eot_id|>");
}

TEST(ChatSamples, ShareGptConversationsRenderLikeMessages) {
  const auto reference = chat_reference();
  nlohmann::json conversations = nlohmann::json::array();
  for (const auto& message : reference["messages"]) {
    const std::string role = message["role"];
    conversations.push_back({{"from", role == "user" ? "human" : role == "assistant" ? "gpt" : role},
                             {"value", message["content"]}});
  }
  EXPECT_EQ(sample_of(builder("chat"), {{"conversations", conversations}}).input_ids,
            reference["ids"].get<std::vector<int64_t>>());
}

TEST(ChatSamples, UnknownRoleAndNoAssistantAreErrorsNamingTheRecord) {
  for (const nlohmann::json& messages :
       {nlohmann::json{{{"role", "narrator"}, {"content", "x"}}, {{"role", "assistant"}, {"content", "y"}}},
        nlohmann::json{{{"role", "user"}, {"content", "x"}}}}) {
    try {
      sample_of(builder("chat"), {{"messages", messages}});
      FAIL() << "expected an error for " << messages.dump();
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("records.jsonl:7"), std::string::npos) << error.what();
    }
  }
}

TEST(TokenIdRecords, AreTakenAsGivenInEveryFormat) {
  const nlohmann::json record = {{"input_ids", {0, 51, 519, 4}}, {"labels", {-100, -100, 519, 4}}};
  for (const std::string format : {"text", "instruct", "chat"}) {
    const auto sample = sample_of(builder(format), record);
    EXPECT_EQ(sample.input_ids, (std::vector<int64_t>{0, 51, 519, 4}));
    EXPECT_EQ(sample.labels, (std::vector<int64_t>{kIgnoreLabel, kIgnoreLabel, 519, 4}));
  }
  EXPECT_EQ(sample_of(builder("text"), {{"input_ids", {5, 6}}}).labels, (std::vector<int64_t>{5, 6}));
  EXPECT_THROW(sample_of(builder("text"), {{"input_ids", {5, 999999}}}), Error);
  EXPECT_THROW(sample_of(builder("text"), {{"input_ids", {5, 6}}, {"labels", {5}}}), Error);
}

}  // namespace
}  // namespace qtrain::data
