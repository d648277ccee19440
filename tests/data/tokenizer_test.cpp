// The byte-level BPE tokenizer against ids made by HF tokenizers (../shared/fixtures).
#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "support.h"
#include "json_support.h"

namespace qtrain::data {
namespace {

using Ids = std::vector<int64_t>;

using testing::read_json;
const Tokenizer& tiny_llama_tokenizer() {
  static const Tokenizer tokenizer = Tokenizer::from_model_dir(qtrain::testing::fixture("tiny-llama"));
  return tokenizer;
}

const nlohmann::json& reference() {
  static const nlohmann::json cases = read_json(qtrain::testing::fixture("tokenizer-reference.json"));
  return cases;
}

nlohmann::json tiny_llama_tokenizer_json() { return read_json(qtrain::testing::fixture("tiny-llama/tokenizer.json")); }

// The message of the qtrain::Error that loading `path` throws ("" when it loads).
std::string load_error(const std::string& path) {
  try {
    Tokenizer::from_file(path);
  } catch (const qtrain::Error& error) {
    return error.what();
  }
  return "";
}

TEST(Tokenizer, IdsEqualHuggingFaceTokenizers) {
  ASSERT_EQ(reference().size(), 25u);
  for (const auto& example : reference()) {
    const std::string text = example["text"];
    EXPECT_EQ(tiny_llama_tokenizer().encode(text, /*add_special_tokens=*/true), example["ids"].get<Ids>()) << text;
  }
}

TEST(Tokenizer, IdsWithoutSpecialTokensEqualHuggingFaceTokenizers) {
  for (const auto& example : reference()) {
    const std::string text = example["text"];
    EXPECT_EQ(tiny_llama_tokenizer().encode(text, /*add_special_tokens=*/false), example["ids_no_special"].get<Ids>())
        << text;
  }
}

TEST(Tokenizer, DecodeGivesBackTheText) {
  for (const auto& example : reference()) {
    const std::string text = example["text"];
    EXPECT_EQ(tiny_llama_tokenizer().decode(example["ids_no_special"].get<Ids>()), text);
  }
}

TEST(Tokenizer, SpecialTokenTextIsOneToken) {
  const Tokenizer& tokenizer = tiny_llama_tokenizer();
  const auto eot = tokenizer.token_to_id("<|eot_id|>");
  const auto header = tokenizer.token_to_id("<|start_header_id|>");
  ASSERT_TRUE(eot && header);
  const Ids ids = tokenizer.encode("<|start_header_id|>Hello world<|eot_id|>", /*add_special_tokens=*/false);
  ASSERT_EQ(ids.size(), 6u);  // header + the 4 ids of "Hello world" (fixture) + eot
  EXPECT_EQ(ids.front(), *header);
  EXPECT_EQ(ids.back(), *eot);
  EXPECT_EQ(Ids(ids.begin() + 1, ids.end() - 1), reference()[0]["ids_no_special"].get<Ids>());
}

TEST(Tokenizer, SpecialTokenIdsComeFromTokenizerConfig) {
  const auto config = read_json(qtrain::testing::fixture("tiny-llama/tokenizer_config.json"));
  const auto added = tiny_llama_tokenizer_json()["added_tokens"];
  auto id_in_tokenizer_json = [&](const std::string& content) -> int64_t {
    for (const auto& token : added) {
      if (token["content"] == content) return token["id"];
    }
    return -1;
  };
  const Tokenizer& tokenizer = tiny_llama_tokenizer();
  EXPECT_EQ(tokenizer.bos_id(), id_in_tokenizer_json(config["bos_token"]));
  EXPECT_EQ(tokenizer.eos_id(), id_in_tokenizer_json(config["eos_token"]));
  EXPECT_EQ(tokenizer.pad_id(), id_in_tokenizer_json(config["pad_token"]));
  EXPECT_EQ(tokenizer.bos_token(), config["bos_token"].get<std::string>());
}

TEST(Tokenizer, VocabSizeIsTheModelsVocabSize) {
  const auto config = read_json(qtrain::testing::fixture("tiny-llama/config.json"));
  EXPECT_EQ(tiny_llama_tokenizer().vocab_size(), config["vocab_size"].get<int64_t>());
}

TEST(Tokenizer, DecodeSkipsSpecialTokensOnlyWhenAsked) {
  const Tokenizer& tokenizer = tiny_llama_tokenizer();
  const auto& example = reference()[0];  // "Hello world", ids with BOS
  const Ids ids = example["ids"].get<Ids>();
  EXPECT_EQ(tokenizer.decode(ids, /*skip_special_tokens=*/true), example["text"].get<std::string>());
  EXPECT_EQ(tokenizer.decode(ids, /*skip_special_tokens=*/false), "<|begin_of_text|>" + example["text"].get<std::string>());
}

TEST(Tokenizer, MergesWrittenAsStringsGiveTheSameIds) {
  // Older tokenizer.json files write a merge as "left right" instead of ["left", "right"].
  auto document = tiny_llama_tokenizer_json();
  for (auto& merge : document["model"]["merges"]) merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
  qtrain::testing::TempDir scratch;
  const Tokenizer tokenizer = Tokenizer::from_file(scratch.write("tokenizer.json", document.dump()));
  for (const auto& example : reference()) {
    EXPECT_EQ(tokenizer.encode(example["text"], /*add_special_tokens=*/false), example["ids_no_special"].get<Ids>());
  }
}

// GPT-2 style: the ByteLevel pre-tokenizer alone splits with GPT-2's pattern after adding a
// leading space; no ignore_merges. Expected ids from tokenizers 0.23.2 on this file.
TEST(Tokenizer, Gpt2StylePreTokenizerEqualsHuggingFaceTokenizers) {
  auto document = tiny_llama_tokenizer_json();
  document["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  document["model"]["ignore_merges"] = false;
  document["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  qtrain::testing::TempDir scratch;
  const Tokenizer tokenizer = Tokenizer::from_file(scratch.write("tokenizer.json", document.dump()));
  const Ids expected = {7102, 84, 878, 17, 347, 371, 226, 2100, 4040, 6, 204, 204, 7895, 226, 1354, 493, 1683, 203, 1120};
  EXPECT_EQ(tokenizer.encode("Hello world, it's 2024!\n\nNew  paragraph\there"), expected);
}

// A post-processor that adds BOS and EOS, inside a Sequence. Expected ids from tokenizers 0.23.2.
TEST(Tokenizer, TemplateWithBosAndEosEqualsHuggingFaceTokenizers) {
  auto document = tiny_llama_tokenizer_json();
  document["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  document["model"]["ignore_merges"] = false;
  auto special = [](const std::string& name) { return nlohmann::json{{"SpecialToken", {{"id", name}, {"type_id", 0}}}}; };
  auto special_entry = [](const std::string& name, int64_t id) {
    return nlohmann::json{{"id", name}, {"ids", {id}}, {"tokens", {name}}};
  };
  nlohmann::json template_processing = {
      {"type", "TemplateProcessing"},
      {"single", {special("<|begin_of_text|>"), {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, special("<|eot_id|>")}},
      {"pair", nlohmann::json::array()},
      {"special_tokens", {{"<|begin_of_text|>", special_entry("<|begin_of_text|>", 0)}, {"<|eot_id|>", special_entry("<|eot_id|>", 4)}}}};
  document["post_processor"] = {
      {"type", "Sequence"},
      {"processors", {{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}},
                      template_processing}}};
  qtrain::testing::TempDir scratch;
  const Tokenizer tokenizer = Tokenizer::from_file(scratch.write("tokenizer.json", document.dump()));
  const Ids expected = {0, 45, 605, 84, 878, 17, 347, 371, 226, 2100, 4040, 6, 204, 204, 7895, 226, 1354, 493, 1683, 203, 1120, 4};
  EXPECT_EQ(tokenizer.encode("Hello world, it's 2024!\n\nNew  paragraph\there"), expected);
  EXPECT_EQ(tokenizer.encode("Hello", /*add_special_tokens=*/false), Ids({45, 605, 84}));
}

// Qwen style: an NFC normalizer, single digits in the split pattern, no ignore_merges.
// Expected ids from tokenizers 0.23.2 on this file: "e" + U+0301 becomes "é", the Hangul jamo
// one syllable, the Angstrom sign U+212B the letter U+00C5.
TEST(Tokenizer, NfcNormalizerEqualsHuggingFaceTokenizers) {
  auto document = tiny_llama_tokenizer_json();
  document["normalizer"] = {{"type", "NFC"}};
  document["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  document["model"]["ignore_merges"] = false;
  document["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  qtrain::testing::TempDir scratch;
  const Tokenizer tokenizer = Tokenizer::from_file(scratch.write("tokenizer.json", document.dump()));
  const Ids expected = {72, 3742, 133, 108, 303, 70, 133, 113, 314, 226, 172, 114, 229,
                        226, 133, 233, 226, 22, 23, 24, 25, 26, 552, 12, 56};
  EXPECT_EQ(tokenizer.encode("cafe\u0301 na\u00efve \u1100\u1161\u11a8 \u212b 12345 It'S"), expected);
}

// Added tokens with lstrip / rstrip / single_word and a second, normalized set. Expected
// ids from tokenizers 0.23.2, which also assigns the ids of added tokens itself.
TEST(Tokenizer, AddedTokenOptionsEqualHuggingFaceTokenizers) {
  auto document = tiny_llama_tokenizer_json();
  auto& added = document["added_tokens"];
  added[4]["lstrip"] = true;  // <|eot_id|>
  added[4]["rstrip"] = true;
  added[5]["single_word"] = true;  // <|pad|>
  auto token = [](int64_t id, const std::string& content, bool single_word, bool lstrip, bool rstrip, bool normalized) {
    return nlohmann::json{{"id", id}, {"content", content}, {"single_word", single_word}, {"lstrip", lstrip},
                          {"rstrip", rstrip}, {"normalized", normalized}, {"special", false}};
  };
  added.push_back(token(8192, "the", true, false, false, true));
  added.push_back(token(8193, "<|", false, false, true, true));
  added.push_back(token(8194, "ing", false, true, false, false));
  qtrain::testing::TempDir scratch;
  const Tokenizer tokenizer = Tokenizer::from_file(scratch.write("tokenizer.json", document.dump()));
  const Ids expected = {0, 70, 4, 71, 8192, 85, 316, 97, 35, 72, 226, 2089, 554, 17, 226, 8192, 2089, 94, 269, 290, 226, 5, 226, 93};
  EXPECT_EQ(tokenizer.encode("a <|eot_id|>  b<|pad|>c the other, <|\n\nthey sing <|pad|> x"), expected);
  EXPECT_EQ(tokenizer.vocab_size(), 8193);
}

TEST(Tokenizer, MalformedFilesAreErrorsNamingTheFile) {
  qtrain::testing::TempDir scratch;
  auto with = [&](const std::string& name, const std::function<void(nlohmann::json&)>& change) {
    auto document = tiny_llama_tokenizer_json();
    change(document);
    return scratch.write(name, document.dump());
  };
  struct Case {
    std::string path;
    std::string expected_in_message;
  };
  const std::vector<Case> cases = {
      {scratch.write("truncated.json", tiny_llama_tokenizer_json().dump().substr(0, 1000)), "not valid JSON"},
      {scratch.write("array.json", "[1, 2]"), "must be a JSON object"},
      {with("unigram.json", [](auto& d) { d["model"]["type"] = "Unigram"; }), "model.type 'Unigram' is not supported"},
      {with("no_model.json", [](auto& d) { d.erase("model"); }), "'model'"},
      {with("vocab_list.json", [](auto& d) { d["model"]["vocab"] = nlohmann::json::array(); }), "model.vocab"},
      {with("bad_id.json", [](auto& d) { d["model"]["vocab"]["Ġthe"] = "seven"; }), "must be an integer"},
      {with("bad_merge.json", [](auto& d) { d["model"]["merges"][3] = {"zz_not_a_token", "a"}; }), "model.merges[3]"},
      {with("merge_number.json", [](auto& d) { d["model"]["merges"][0] = 5; }), "model.merges[0]"},
      {with("nfkc.json", [](auto& d) { d["normalizer"] = {{"type", "NFKC"}}; }), "normalizer.type 'NFKC'"},
      {with("metaspace.json", [](auto& d) { d["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}, {"prepend_scheme", "twice"}}; }),
       "pre_tokenizer.prepend_scheme 'twice'"},
      {with("bad_regex.json", [](auto& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
       "does not compile"},
      {with("dropout.json", [](auto& d) { d["model"]["dropout"] = 0.1; }), "model.dropout"},
      {with("added_not_list.json", [](auto& d) { d["added_tokens"] = 3; }), "added_tokens"},
      {with("unknown_special.json", [](auto& d) { d["post_processor"]["single"][0]["SpecialToken"]["id"] = "<nope>"; }),
       "'post_processor.special_tokens.<nope>'"},
      {with("wordpiece_decoder.json", [](auto& d) { d["decoder"] = {{"type", "WordPiece"}}; }), "decoder.type 'WordPiece'"},
      {scratch.path() + "/missing.json", "not found"},
  };
  for (const Case& test_case : cases) {
    const std::string message = load_error(test_case.path);
    EXPECT_NE(message.find(test_case.path), std::string::npos) << "no file name in: " << message;
    EXPECT_NE(message.find(test_case.expected_in_message), std::string::npos)
        << test_case.path << ": '" << test_case.expected_in_message << "' not in: " << message;
  }
}

TEST(Tokenizer, InvalidUtf8IsEncodedByteByByte) {
  const Tokenizer& tokenizer = tiny_llama_tokenizer();
  // Every single byte, valid UTF-8 or not, is one token of the byte-level alphabet.
  std::vector<int64_t> byte_ids;
  for (int byte = 0; byte < 256; ++byte) {
    const Ids ids = tokenizer.encode(std::string(1, static_cast<char>(byte)), /*add_special_tokens=*/false);
    ASSERT_EQ(ids.size(), 1u) << "byte " << byte;
    byte_ids.push_back(ids[0]);
  }
  std::sort(byte_ids.begin(), byte_ids.end());
  EXPECT_EQ(std::unique(byte_ids.begin(), byte_ids.end()), byte_ids.end());
  // Mixed text: the valid parts tokenize as usual; decoding replaces the invalid bytes with
  // U+FFFD, as tokenizers' from_utf8_lossy does.
  const std::string text = "Hello world\xff\xfe and \xc3 caf\xc3\xa9 \xe2\x82";
  const Ids ids = tokenizer.encode(text, /*add_special_tokens=*/false);
  EXPECT_EQ(Ids(ids.begin(), ids.begin() + 4), reference()[0]["ids_no_special"].get<Ids>());
  EXPECT_EQ(tokenizer.decode(ids), "Hello world\xef\xbf\xbd\xef\xbf\xbd and \xef\xbf\xbd caf\xc3\xa9 \xef\xbf\xbd");
}

TEST(Tokenizer, HugeWhitespaceRunDoesNotExhaustTheRegexStack) {
  const std::string text = "a" + std::string(1 << 20, ' ') + "b" + std::string(1 << 18, '\n');
  const Ids ids = tiny_llama_tokenizer().encode(text, /*add_special_tokens=*/false);
  EXPECT_EQ(tiny_llama_tokenizer().decode(ids), text);
}

TEST(Tokenizer, UnknownIdsAreLeftOutOfDecode) {
  const Tokenizer& tokenizer = tiny_llama_tokenizer();
  Ids ids = reference()[0]["ids_no_special"].get<Ids>();
  ids.insert(ids.begin() + 1, {-1, tokenizer.vocab_size(), 1LL << 40});
  EXPECT_EQ(tokenizer.decode(ids), reference()[0]["text"].get<std::string>());
}

}  // namespace
}  // namespace qtrain::data
