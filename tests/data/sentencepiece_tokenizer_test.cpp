// Sentencepiece-style tokenizer.json files (Llama 2, Mistral: "▁" for spaces, <0xXX> byte
// fallback) against the ids and decoded text of HF tokenizers, recorded in
// tests/data/sentencepiece/reference.json by tests/interop/make_sentencepiece_reference.py.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "kernels/error.h"
#include "support.h"
#include "json_support.h"

namespace qtrain::data {
namespace {

using Ids = std::vector<int64_t>;

std::string reference_dir() { return qtrain::testing::source_dir() + "/tests/data/sentencepiece"; }

using testing::read_json;
const nlohmann::json& sentencepiece_reference() {
  static const nlohmann::json document = read_json(reference_dir() + "/reference.json");
  return document;
}

// A variant is one of the two tokenizer folders, its tokenizer.json changed by a JSON merge
// patch (the script's way of covering more options without more vocabularies).
const Tokenizer& tokenizer_of(const std::string& variant_name) {
  static std::map<std::string, Tokenizer> loaded;
  static qtrain::testing::TempDir scratch;
  if (auto found = loaded.find(variant_name); found != loaded.end()) return found->second;
  const nlohmann::json& variant = sentencepiece_reference()["variants"][variant_name];
  const std::string base_dir = reference_dir() + "/" + variant["tokenizer"].get<std::string>();
  std::string model_dir = base_dir;
  if (!variant["patch"].empty()) {
    nlohmann::json document = read_json(base_dir + "/tokenizer.json");
    document.merge_patch(variant["patch"]);
    scratch.write(variant_name + "/tokenizer.json", document.dump());
    scratch.write(variant_name + "/tokenizer_config.json", read_json(base_dir + "/tokenizer_config.json").dump());
    model_dir = scratch.file(variant_name);
  }
  return loaded.emplace(variant_name, Tokenizer::from_model_dir(model_dir)).first->second;
}

// Calls check(variant name, tokenizer, case) for every case of every variant.
void for_each_case(const std::function<void(const std::string&, const Tokenizer&, const nlohmann::json&)>& check) {
  for (const auto& [name, variant] : sentencepiece_reference()["variants"].items()) {
    const Tokenizer& tokenizer = tokenizer_of(name);
    for (const auto& example : variant["cases"]) check(name, tokenizer, example);
  }
}

TEST(SentencepieceTokenizer, ReferenceCoversEveryVariant) {
  const std::vector<std::string> expected = {"llama2", "mistral", "mistral-llama2-decoder", "llama2-no-byte-fallback",
                                             "metaspace-always-split", "regex-replace-never", "llama2-added-tokens"};
  ASSERT_EQ(sentencepiece_reference()["variants"].size(), expected.size());
  for (const std::string& name : expected) {
    ASSERT_TRUE(sentencepiece_reference()["variants"].contains(name)) << name;
    EXPECT_EQ(sentencepiece_reference()["variants"][name]["cases"].size(), 46u) << name;
  }
}

TEST(SentencepieceTokenizer, IdsEqualHuggingFaceTokenizers) {
  for_each_case([](const std::string& variant, const Tokenizer& tokenizer, const nlohmann::json& example) {
    const std::string text = example["text"];
    EXPECT_EQ(tokenizer.encode(text, /*add_special_tokens=*/true), example["ids"].get<Ids>())
        << variant << ": '" << text << "'";
  });
}

TEST(SentencepieceTokenizer, IdsWithoutSpecialTokensEqualHuggingFaceTokenizers) {
  for_each_case([](const std::string& variant, const Tokenizer& tokenizer, const nlohmann::json& example) {
    const std::string text = example["text"];
    EXPECT_EQ(tokenizer.encode(text, /*add_special_tokens=*/false), example["ids_no_special"].get<Ids>())
        << variant << ": '" << text << "'";
  });
}

TEST(SentencepieceTokenizer, DecodeEqualsHuggingFaceTokenizers) {
  for_each_case([](const std::string& variant, const Tokenizer& tokenizer, const nlohmann::json& example) {
    const Ids ids = example["ids"].get<Ids>();
    EXPECT_EQ(tokenizer.decode(ids, /*skip_special_tokens=*/false), example["decoded"].get<std::string>())
        << variant << ": '" << example["text"].get<std::string>() << "'";
    EXPECT_EQ(tokenizer.decode(ids, /*skip_special_tokens=*/true), example["decoded_skip_special"].get<std::string>())
        << variant << ": '" << example["text"].get<std::string>() << "' (skipping special tokens)";
  });
}

TEST(SentencepieceTokenizer, SpecialTokenIdsComeFromTokenizerConfig) {
  const Tokenizer& tokenizer = tokenizer_of("llama2");
  EXPECT_EQ(tokenizer.bos_id(), 1);
  EXPECT_EQ(tokenizer.eos_id(), 2);
  EXPECT_EQ(tokenizer.bos_token(), "<s>");
  EXPECT_EQ(tokenizer.vocab_size(), 3 + 256 + 1497);  // specials, byte tokens, learned pieces
  EXPECT_EQ(tokenizer.token_to_id("<0x0A>"), 3 + 0x0A);
}

// tokenizers cannot be given invalid UTF-8, so there is no reference; qtrain's promise is that
// each invalid byte becomes its own byte token and decoding shows it as U+FFFD.
TEST(SentencepieceTokenizer, InvalidUtf8FallsBackToByteTokens) {
  const Tokenizer& tokenizer = tokenizer_of("llama2");
  const Ids ids = tokenizer.encode("a\xff", /*add_special_tokens=*/false);
  const Ids a = tokenizer.encode("a", /*add_special_tokens=*/false);
  Ids expected = a;
  expected.push_back(3 + 0xFF);
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(tokenizer.decode(ids), "a\xef\xbf\xbd");
}

TEST(SentencepieceTokenizer, UnsupportedOptionsAreErrorsNamingTheKey) {
  qtrain::testing::TempDir scratch;
  const nlohmann::json llama2 = read_json(reference_dir() + "/llama2/tokenizer.json");
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> change;
    std::string expected_in_message;
  };
  const std::vector<Case> cases = {
      {"lowercase", [](auto& d) { d["normalizer"]["normalizers"][0] = {{"type", "Lowercase"}}; },
       "normalizer.normalizers[0].type 'Lowercase' is not supported"},
      {"replace_without_pattern", [](auto& d) { d["normalizer"]["normalizers"][1].erase("pattern"); },
       "normalizer.normalizers[1]"},
      {"long_replacement", [](auto& d) { d["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "__"}}; },
       "pre_tokenizer.replacement must be one character"},
      {"contradicting_prefix", [](auto& d) {
         d["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}, {"add_prefix_space", false}};
       }, "pre_tokenizer.add_prefix_space"},
      {"ctc_decoder", [](auto& d) { d["decoder"]["decoders"][1] = {{"type", "CTC"}}; },
       "decoder.decoders[1].type 'CTC' is not supported"},
      {"strip_two_characters", [](auto& d) { d["decoder"]["decoders"][3]["content"] = "ab"; },
       "decoder.decoders[3].content must be one character"},
  };
  for (const Case& test_case : cases) {
    nlohmann::json document = llama2;
    test_case.change(document);
    const std::string path = scratch.write(test_case.name + ".json", document.dump());
    std::string message;
    try {
      Tokenizer::from_file(path);
    } catch (const qtrain::Error& error) {
      message = error.what();
    }
    EXPECT_NE(message.find(path), std::string::npos) << "no file name in: " << message;
    EXPECT_NE(message.find(test_case.expected_in_message), std::string::npos)
        << test_case.name << ": '" << test_case.expected_in_message << "' not in: " << message;
  }
}

}  // namespace
}  // namespace qtrain::data
