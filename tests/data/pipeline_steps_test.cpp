// Pre-tokenizers, normalizers and decoders one by one against what HF tokenizers gives for the
// same config, recorded in tests/data/pipeline/reference.json by
// tests/data/pipeline/make_reference.py.
#include <gtest/gtest.h>

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

const nlohmann::json& reference() {
  static const nlohmann::json document = [] {
    std::ifstream input(qtrain::testing::source_dir() + "/tests/data/pipeline/reference.json");
    return nlohmann::json::parse(input);
  }();
  return document;
}

const std::string kFile = "reference.json";

TEST(PipelineSteps, PreTokenizersCutAsHuggingFaceTokenizers) {
  const Strings texts = reference()["texts"];
  ASSERT_EQ(reference()["pre_tokenizers"].size(), 11u);
  for (const auto& entry : reference()["pre_tokenizers"]) {
    const PreTokenizer pre_tokenizer = PreTokenizer::from_json(JsonNode(entry["config"], kFile));
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(pre_tokenizer.split(texts[i], /*starts_input=*/true), entry["pieces"][i].get<Strings>())
          << entry["config"].dump() << " on '" << texts[i] << "'";
    }
  }
}

TEST(PipelineSteps, NormalizersEqualHuggingFaceTokenizers) {
  const Strings texts = reference()["texts"];
  ASSERT_EQ(reference()["normalizers"].size(), 6u);
  for (const auto& entry : reference()["normalizers"]) {
    const Normalizer normalizer = Normalizer::from_json(JsonNode(entry["config"], kFile));
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(normalizer.normalize(texts[i]), entry["normalized"][i].get<std::string>())
          << entry["config"].dump() << " on '" << texts[i] << "'";
    }
  }
}

TEST(PipelineSteps, DecodersEqualHuggingFaceTokenizers) {
  ASSERT_EQ(reference()["decoders"].size(), 2u);
  for (const auto& entry : reference()["decoders"]) {
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
