// A Gemma-layout tokenizer.json (no pre-tokenizer in effect: BPE sees all the text between
// added tokens at once) against the ids and decoded text of HF tokenizers, recorded in
// tests/data/gemma/reference.json by tests/interop/make_gemma_tokenizer_reference.py.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "support.h"

namespace qtrain::data {
namespace {

using Ids = std::vector<int64_t>;

std::string gemma_dir() { return qtrain::testing::source_dir() + "/tests/data/gemma"; }

const nlohmann::json& reference_cases() {
  static const nlohmann::json cases = [] {
    std::ifstream input(gemma_dir() + "/reference.json");
    return nlohmann::json::parse(input)["cases"];
  }();
  return cases;
}

const Tokenizer& gemma_tokenizer() {
  static const Tokenizer tokenizer = Tokenizer::from_model_dir(gemma_dir());
  return tokenizer;
}

TEST(GemmaTokenizer, ReferenceHasEdgeCasesAndWholeDocuments) {
  ASSERT_EQ(reference_cases().size(), 53u);
  size_t longest = 0;
  for (const auto& example : reference_cases()) longest = std::max(longest, example["text"].get<std::string>().size());
  EXPECT_GT(longest, 5000u);
}

TEST(GemmaTokenizer, IdsEqualHuggingFaceTokenizers) {
  for (const auto& example : reference_cases()) {
    const std::string text = example["text"];
    EXPECT_EQ(gemma_tokenizer().encode(text, /*add_special_tokens=*/true), example["ids"].get<Ids>()) << text;
    EXPECT_EQ(gemma_tokenizer().encode(text, /*add_special_tokens=*/false), example["ids_no_special"].get<Ids>()) << text;
  }
}

TEST(GemmaTokenizer, DecodeEqualsHuggingFaceTokenizers) {
  for (const auto& example : reference_cases()) {
    const Ids ids = example["ids"].get<Ids>();
    EXPECT_EQ(gemma_tokenizer().decode(ids, /*skip_special_tokens=*/false), example["decoded"].get<std::string>());
    EXPECT_EQ(gemma_tokenizer().decode(ids, /*skip_special_tokens=*/true), example["decoded_skip_special"].get<std::string>());
  }
}

// The BPE cuts long input into words before "▁" only where no token joins the character
// before to "▁": "e▁" is a token here, so "the▁cat" stays whole; cached words must not change
// a later encoding either.
TEST(GemmaTokenizer, RepeatedEncodingGivesTheSameIds) {
  for (int round = 0; round < 2; ++round) {
    for (const auto& example : reference_cases()) {
      const std::string text = example["text"];
      ASSERT_EQ(gemma_tokenizer().encode(text, /*add_special_tokens=*/false), example["ids_no_special"].get<Ids>())
          << "round " << round << ": " << text;
    }
  }
}

}  // namespace
}  // namespace qtrain::data
