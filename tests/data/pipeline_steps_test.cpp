// Pre-tokenizers, normalizers and decoders one by one against what HF tokenizers gives for the
// same config, recorded in tests/data/pipeline/reference.json by
// tests/interop/make_pipeline_steps_reference.py.
#include <gtest/gtest.h>

#include <functional>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/decoder.h"
#include "data/normalizer.h"
#include "data/pre_tokenizer.h"
#include "kernels/error.h"
#include "support.h"

namespace qtrain::data {
namespace {

using Strings = std::vector<std::string>;

const nlohmann::json& steps_reference() {
  static const nlohmann::json document = [] {
    std::ifstream input(qtrain::testing::source_dir() + "/tests/data/pipeline/reference.json");
    return nlohmann::json::parse(input);
  }();
  return document;
}

const std::string kFile = "reference.json";

// The reference's texts, each through every step of `section` (`count` of them): `output` gives
// the step's result, which must equal the reference's `field` for that text.
template <typename Step>
void expect_each_text_as_reference(const std::string& section, size_t count, const std::string& field,
                                   const std::function<nlohmann::json(const Step&, const std::string&)>& output) {
  const Strings texts = steps_reference()["texts"];
  ASSERT_EQ(steps_reference()[section].size(), count);
  for (const auto& entry : steps_reference()[section]) {
    const Step step = Step::from_json(JsonNode(entry["config"], kFile));
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(output(step, texts[i]), entry[field][i]) << entry["config"].dump() << " on '" << texts[i] << "'";
    }
  }
}

TEST(PipelineSteps, PreTokenizersCutAsHuggingFaceTokenizers) {
  expect_each_text_as_reference<PreTokenizer>("pre_tokenizers", 11, "pieces", [](const PreTokenizer& step, const std::string& text) {
    return nlohmann::json(step.split(text, /*starts_input=*/true));
  });
}

TEST(PipelineSteps, NormalizersEqualHuggingFaceTokenizers) {
  expect_each_text_as_reference<Normalizer>("normalizers", 6, "normalized", [](const Normalizer& step, const std::string& text) {
    return nlohmann::json(step.normalize(text));
  });
}

TEST(PipelineSteps, DecodersEqualHuggingFaceTokenizers) {
  ASSERT_EQ(steps_reference()["decoders"].size(), 2u);
  for (const auto& entry : steps_reference()["decoders"]) {
    const Decoder decoder = Decoder::from_json(JsonNode(entry["config"], kFile));
    for (const auto& example : entry["cases"]) {
      EXPECT_EQ(decoder.decode(example["tokens"].get<Strings>()), example["decoded"].get<std::string>())
          << entry["config"].dump() << " on " << example["tokens"].dump();
    }
  }
}

// The steps of tokenizers 0.23 that qtrain refuses, each by name and with why.
TEST(PipelineSteps, StepsNoBpeModelUsesAreRefusedWithTheReason) {
  auto error_of = [](const std::function<void()>& load) -> std::string {
    try {
      load();
    } catch (const qtrain::Error& error) {
      return error.what();
    }
    return "";
  };
  struct Case {
    nlohmann::json config;
    std::string kind;  // pre_tokenizer, normalizer or decoder
    std::string expected_in_message;
  };
  const std::vector<Case> cases = {
      {{{"type", "UnicodeScripts"}}, "pre_tokenizer", "'UnicodeScripts' is not supported (it cuts where the Unicode script"},
      {{{"type", "FixedLength"}, {"length", 5}}, "pre_tokenizer", "'FixedLength' is not supported (it cuts text into pieces"},
      {{{"type", "CharDelimiterSplit"}, {"delimiter", "ab"}}, "pre_tokenizer", "delimiter must be one character"},
      {{{"type", "BertNormalizer"}}, "normalizer", "'BertNormalizer' is not supported (it comes with BERT's WordPiece"},
      {{{"type", "Precompiled"}}, "normalizer", "'Precompiled' is not supported (it comes with sentencepiece Unigram"},
      {{{"type", "Nmt"}}, "normalizer", "'Nmt' is not supported (it comes with sentencepiece Unigram"},
      {{{"type", "NFKC"}}, "normalizer", "'NFKC' is not supported yet (it needs Unicode compatibility tables"},
      {{{"type", "Lowercase"}}, "normalizer", "'Lowercase' is not supported yet (it needs Unicode case tables"},
      {{{"type", "WordPiece"}}, "decoder", "'WordPiece' is not supported (it comes with BERT's WordPiece models"},
      {{{"type", "CTC"}}, "decoder", "'CTC' is not supported (it comes with CTC speech models"},
  };
  for (const Case& test_case : cases) {
    const JsonNode node(test_case.config, "tokenizer.json", test_case.kind);
    const std::string message = error_of([&] {
      if (test_case.kind == "pre_tokenizer") PreTokenizer::from_json(node);
      if (test_case.kind == "normalizer") Normalizer::from_json(node);
      if (test_case.kind == "decoder") Decoder::from_json(node);
    });
    EXPECT_NE(message.find("tokenizer.json: " + test_case.kind), std::string::npos) << message;
    EXPECT_NE(message.find(test_case.expected_in_message), std::string::npos)
        << test_case.config.dump() << ": '" << test_case.expected_in_message << "' not in: " << message;
  }
}

}  // namespace
}  // namespace qtrain::data
