// GGUF export's tokenizer: llama.cpp (llama-cpp-python), reading only the tokenizer.ggml.*
// metadata we write, gives the ids our tokenizer gives (which equal the tokenizers library's,
// tests/data), on every text of the shared tokenizer references, with and without the special
// tokens the post-processor adds; and a tokenizer llama.cpp cannot hold is refused by its key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "kernels/error.h"
#include "support.h"
#include "trainer/formats/base_directory.h"
#include "trainer/formats/gguf_file.h"
#include "trainer/formats/gguf_tokenizer.h"
#include "trainer/formats/hf_config.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;
using testing::TempDir;
using Json = nlohmann::json;

constexpr const char* kLlamaCppModules = "llama_cpp tokenizers";

std::string source_file(const std::string& relative) { return testing::source_dir() + "/" + relative; }

// Every text of tests/data/sentencepiece/reference.json, tests/data/gemma/reference.json and
// ../shared/fixtures/tokenizer-reference.json, once each, in that order.
std::vector<std::string> reference_texts() {
  std::vector<std::string> texts;
  auto add = [&](const Json& cases) {
    for (const auto& item : cases) {
      const auto text = item.at("text").get<std::string>();
      if (std::find(texts.begin(), texts.end(), text) == texts.end()) texts.push_back(text);
    }
  };
  const auto sentencepiece = Json::parse(testing::read_text(source_file("tests/data/sentencepiece/reference.json")));
  for (const auto& [name, variant] : sentencepiece.at("variants").items()) add(variant.at("cases"));
  add(Json::parse(testing::read_text(source_file("tests/data/gemma/reference.json"))).at("cases"));
  add(Json::parse(testing::read_text(fixture("tokenizer-reference.json"))));
  return texts;
}

// The export's view of a model directory holding `tokenizer_dir`'s tokenizer: tiny-llama's
// config.json with the tokenizer's vocabulary size (the metadata pads to it) and without its
// special token ids.
BaseDirectory base_of(const std::string& tokenizer_dir) {
  auto config = Json::parse(testing::read_text(fixture("tiny-llama/config.json")));
  config["vocab_size"] = data::Tokenizer::from_model_dir(tokenizer_dir).vocab_size();
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) config.erase(key);  // the tokenizer's own
  return BaseDirectory::read(tokenizer_dir, parse_hf_config(config.dump(), tokenizer_dir + "/config.json"));
}

// A GGUF file holding the tokenizer metadata and the least of a "llama" architecture that
// llama.cpp's vocab_only load reads; no tensors.
GgufFile write_tokenizer_gguf(const BaseDirectory& base, const std::string& path) {
  const auto vocab_size = static_cast<uint32_t>(base.config.llama.vocab_size);
  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"general.architecture", std::string("llama")},
      {"general.name", std::string("tokenizer-test")},
      {"llama.vocab_size", vocab_size},
      {"llama.context_length", uint32_t{2048}},
      {"llama.embedding_length", uint32_t{64}},
      {"llama.block_count", uint32_t{1}},
      {"llama.feed_forward_length", uint32_t{128}},
      {"llama.attention.head_count", uint32_t{2}},
      {"llama.attention.head_count_kv", uint32_t{2}},
      {"llama.attention.layer_norm_rms_epsilon", 1e-5f},
      {"llama.rope.dimension_count", uint32_t{32}},
  };
  for (auto& entry : gguf_tokenizer_metadata(base)) metadata.push_back(std::move(entry));
  write_gguf(path, metadata, {});
  return GgufFile::open(path);
}

struct Tokenization {
  std::vector<std::vector<int64_t>> with_special;
  std::vector<std::vector<int64_t>> without_special;
};

// llama.cpp's ids for `texts` from the GGUF file at `path`.
Tokenization llama_cpp_ids(const TempDir& temp, const std::string& path, const std::vector<std::string>& texts) {
  const auto texts_path = temp.write("texts.json", Json(texts).dump());
  const auto out_path = temp.file("llama_cpp_ids.json");
  const auto result = testing::run_interop_script("gguf_tokenizer.py", "tokenize '" + path + "' '" + texts_path + "' '" + out_path + "'");
  EXPECT_EQ(result.status, 0) << result.output;
  if (result.status != 0) return {};
  const auto ids = Json::parse(testing::read_text(out_path));
  return {ids.at("with_special").get<std::vector<std::vector<int64_t>>>(),
          ids.at("without_special").get<std::vector<std::vector<int64_t>>>()};
}

std::string shown(const std::vector<int64_t>& ids) { return Json(ids).dump(); }

// Expects llama.cpp's ids for every text to equal `tokenizer`'s; returns how many differ.
int expect_same_ids(const data::Tokenizer& tokenizer, const std::vector<std::string>& texts, const Tokenization& llama_cpp,
                    const std::string& name) {
  if (llama_cpp.with_special.size() != texts.size() || llama_cpp.without_special.size() != texts.size()) {
    ADD_FAILURE() << name << ": llama.cpp tokenized " << llama_cpp.with_special.size() << " of " << texts.size() << " texts";
    return static_cast<int>(texts.size());
  }
  int differing = 0;
  for (size_t index = 0; index < texts.size(); ++index) {
    for (const bool add_special : {true, false}) {
      const auto ours = tokenizer.encode(texts[index], add_special);
      const auto& theirs = add_special ? llama_cpp.with_special[index] : llama_cpp.without_special[index];
      if (ours != theirs) {
        ++differing;
        ADD_FAILURE() << name << (add_special ? " with" : " without") << " special tokens, text " << Json(texts[index]).dump()
                      << "\n  ours      " << shown(ours) << "\n  llama.cpp " << shown(theirs);
      }
    }
  }
  return differing;
}

struct TokenizerCase {
  const char* name;
  const char* directory;       // tests/data/... (source) or a fixture; nullptr: a byte-level BPE made now
  const char* gguf_model;
  const char* gguf_pre;        // made ones: with the pre-tokenizer of the models llama.cpp calls so
};

void PrintTo(const TokenizerCase& tokenizer_case, std::ostream* out) { *out << tokenizer_case.name; }

const TokenizerCase kTokenizerCases[] = {
    {"llama2", "tests/data/sentencepiece/llama2", "llama", "default"},
    {"gemma", "tests/data/gemma", "llama", "default"},
    {"tiny_llama", "tiny-llama", "gpt2", "llama-bpe"},
    {"o200k", nullptr, "gpt2", "gpt-4o"},
    {"llama3_regex", nullptr, "gpt2", "llama-bpe"},
    {"llama3_regex_with_merges", nullptr, "gpt2", "dbrx"},
    {"qwen2", nullptr, "gpt2", "qwen2"},
    {"qwen35", nullptr, "gpt2", "qwen35"},
    {"tekken", nullptr, "gpt2", "tekken"},
    {"seed_coder", nullptr, "gpt2", "seed-coder"},
    {"bailing_moe", nullptr, "gpt2", "bailingmoe"},
    {"exaone_moe", nullptr, "gpt2", "exaone-moe"},
    {"jais2", nullptr, "gpt2", "jais-2"},
    {"deepseek_v3", nullptr, "gpt2", "deepseek-v3"},
    {"deepseek_coder", nullptr, "gpt2", "deepseek-coder"},
    {"gpt2", nullptr, "gpt2", "gpt-2"},
    {"starcoder", nullptr, "gpt2", "starcoder"},
};

// Where a case's tokenizer files are: in the sources, among the fixtures, or trained now in `temp`
// by tests/interop/gguf_tokenizer.py.
std::string tokenizer_directory(const TokenizerCase& tokenizer_case, const TempDir& temp) {
  if (tokenizer_case.directory == nullptr) {
    const auto directory = temp.file(std::string("tokenizer-") + tokenizer_case.name);
    const auto result = testing::run_interop_script("gguf_tokenizer.py", "make-byte-level '" + directory + "' " + tokenizer_case.gguf_pre);
    EXPECT_EQ(result.status, 0) << result.output;
    return directory;
  }
  const std::string directory = tokenizer_case.directory;
  return directory.rfind("tests/", 0) == 0 ? source_file(directory) : fixture(directory);
}

class GgufTokenizer : public ::testing::TestWithParam<TokenizerCase> {};

TEST_P(GgufTokenizer, LlamaCppGivesOurIdsOnEveryReferenceText) {
  if (const auto lacking = testing::python_lacks(kLlamaCppModules); !lacking.empty()) GTEST_SKIP() << lacking;
  TempDir temp;
  const auto directory = tokenizer_directory(GetParam(), temp);
  const auto base = base_of(directory);
  const auto file = write_tokenizer_gguf(base, temp.file("tokenizer.gguf"));
  EXPECT_EQ(file.value("tokenizer.ggml.model").as<std::string>("model"), GetParam().gguf_model);
  EXPECT_EQ(file.value("tokenizer.ggml.pre").as<std::string>("pre"), GetParam().gguf_pre);
  const auto texts = reference_texts();
  EXPECT_GE(texts.size(), 70u);
  const int differing = expect_same_ids(base.tokenizer(), texts, llama_cpp_ids(temp, temp.file("tokenizer.gguf"), texts),
                                        GetParam().name);
  std::printf("[ measured ] %s: %d of %zu tokenizations differ\n", GetParam().name, differing, 2 * texts.size());
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, GgufTokenizer, ::testing::ValuesIn(kTokenizerCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Mistral's Metaspace(prepend_scheme "first") puts no "▁" before a text that starts with a space
// or after an added token; llama.cpp's sentencepiece tokenizer (and sentencepiece itself, which
// the model was trained with) does, as tokenizers does for Llama 2's Prepend layout: the export
// writes it as that layout, and llama.cpp gives the ids of the Llama 2 layout of the same vocabulary.
TEST(GgufTokenizerMetaspace, TokenizesAsSentencepieceWithItsPrefixSpace) {
  if (const auto lacking = testing::python_lacks(kLlamaCppModules); !lacking.empty()) GTEST_SKIP() << lacking;
  TempDir temp;
  const auto mistral = base_of(source_file("tests/data/sentencepiece/mistral"));
  const auto file = write_tokenizer_gguf(mistral, temp.file("mistral.gguf"));
  EXPECT_EQ(file.value("tokenizer.ggml.model").as<std::string>("model"), "llama");
  EXPECT_TRUE(file.value("tokenizer.ggml.add_space_prefix").as<bool>("add_space_prefix"));
  const auto texts = reference_texts();
  const auto llama_cpp = llama_cpp_ids(temp, temp.file("mistral.gguf"), texts);
  const auto llama2_layout = data::Tokenizer::from_model_dir(source_file("tests/data/sentencepiece/llama2"));
  EXPECT_EQ(expect_same_ids(llama2_layout, texts, llama_cpp, "mistral as llama2's layout"), 0);
  // Elsewhere Metaspace's own ids are llama.cpp's.
  std::vector<std::string> unaffected;
  for (const auto& text : texts) {
    const bool leading_space = !text.empty() && (text[0] == ' ' || text.rfind("\u2581", 0) == 0);
    const bool added_token = text.find("<s>") != std::string::npos || text.find("</s>") != std::string::npos ||
                             text.find("<unk>") != std::string::npos;
    if (!leading_space && !added_token) unaffected.push_back(text);
  }
  EXPECT_GE(unaffected.size(), 50u);
  EXPECT_EQ(expect_same_ids(mistral.tokenizer(), unaffected, llama_cpp_ids(temp, temp.file("mistral.gguf"), unaffected),
                            "mistral"),
            0);
}

// Merge number r makes a token of score -r, so that llama.cpp's sentencepiece tokenizer merges in
// tokenizers' order; types mark unknown, control and byte tokens.
TEST(GgufTokenizerSentencepiece, ScoresFollowTheMergesAndTypesNameByteAndSpecialTokens) {
  TempDir temp;
  const auto base = base_of(source_file("tests/data/sentencepiece/llama2"));
  const auto file = write_tokenizer_gguf(base, temp.file("llama2.gguf"));
  const auto& tokenizer = base.tokenizer();
  const auto scores = file.value("tokenizer.ggml.scores").array_as<float>("scores");
  const auto types = file.value("tokenizer.ggml.token_type").array_as<int32_t>("types");
  ASSERT_EQ(scores.size(), static_cast<size_t>(tokenizer.vocab_size()));
  const auto merges = tokenizer.merges();
  for (size_t rank = 0; rank < 20; ++rank) {
    const auto id = tokenizer.token_to_id(merges[rank].first + merges[rank].second);
    ASSERT_TRUE(id.has_value());
    EXPECT_EQ(scores[*id], -static_cast<float>(rank)) << merges[rank].first << " " << merges[rank].second;
  }
  EXPECT_EQ(types[0], 2);                                        // <unk>: unknown
  EXPECT_EQ(types[1], 3);                                        // <s>: control
  EXPECT_EQ(types[*tokenizer.token_to_id("<0x0A>")], 6);         // byte
  EXPECT_EQ(types[*tokenizer.token_to_id("\u2581the")], 1);      // normal
  EXPECT_EQ(file.value("tokenizer.ggml.unknown_token_id").as<uint32_t>("unk"), 0u);
  EXPECT_EQ(file.value("tokenizer.ggml.bos_token_id").as<uint32_t>("bos"), 1u);
  EXPECT_EQ(file.value("tokenizer.ggml.eos_token_id").as<uint32_t>("eos"), 2u);
  EXPECT_TRUE(file.value("tokenizer.ggml.add_bos_token").as<bool>("add_bos"));
  EXPECT_FALSE(file.value("tokenizer.ggml.add_eos_token").as<bool>("add_eos"));
  EXPECT_TRUE(file.value("tokenizer.ggml.add_space_prefix").as<bool>("add_space_prefix"));
  EXPECT_FALSE(file.contains("tokenizer.ggml.merges"));
  const auto gemma_file = write_tokenizer_gguf(base_of(source_file("tests/data/gemma")), temp.file("gemma.gguf"));
  EXPECT_FALSE(gemma_file.value("tokenizer.ggml.add_space_prefix").as<bool>("add_space_prefix"));
}

// A copy of `tokenizer_dir`'s tokenizer in `temp` with `patch` merged into tokenizer.json (RFC 7386).
std::string patched_tokenizer(const TempDir& temp, const std::string& name, const std::string& tokenizer_dir, const Json& patch) {
  auto document = Json::parse(testing::read_text(tokenizer_dir + "/tokenizer.json"));
  document.merge_patch(patch);
  temp.write(name + "/tokenizer.json", document.dump());
  temp.write(name + "/tokenizer_config.json", testing::read_text(tokenizer_dir + "/tokenizer_config.json"));
  return temp.file(name);
}

TEST(GgufTokenizerRefusal, WhatLlamaCppCannotHoldIsAnErrorNamingTheTokenizerJsonKey) {
  TempDir temp;
  const auto llama2 = source_file("tests/data/sentencepiece/llama2");
  const auto llama3 = fixture("tiny-llama");
  const Json split = {{"type", "Split"}, {"pattern", {{"Regex", "\\p{L}+|\\p{N}+"}}}, {"behavior", "Isolated"}, {"invert", false}};
  const Json qwen2_split = {
      {"type", "Split"},
      {"pattern",
       {{"Regex", R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}}},
      {"behavior", "Isolated"},
      {"invert", false}};
  const Json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  const Json metaspace_split = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}, {"split", true}};
  const struct {
    const char* name;
    std::string tokenizer_dir;
    Json patch;
    const char* key;
  } refused[] = {
      {"unknown-regex", llama3, {{"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {split, byte_level}}}}}, "pre_tokenizer"},
      {"prefix-space", llama3,
       {{"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}, {"pretokenizers", nullptr}}}},
       "pre_tokenizer"},
      // Qwen2's regex, which llama.cpp runs with merges, and ignore_merges as Llama 3's file has it
      {"qwen2-ignore-merges", llama3, {{"pre_tokenizer", {{"pretokenizers", {qwen2_split, byte_level}}}}}, "model.ignore_merges"},
      {"byte-level-lowercase", llama3, {{"normalizer", {{"type", "Lowercase"}}}}, "normalizer"},
      {"wordpiece", llama3, {{"model", {{"type", "WordPiece"}}}}, "model.type"},
      {"metaspace-split", llama2, {{"normalizer", nullptr}, {"pre_tokenizer", metaspace_split}}, "pre_tokenizer"},
      {"sentencepiece-nfc", llama2,
       {{"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Prepend"}, {"prepend", "\u2581"}},
                                                                {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}}},
       "normalizer"},
      {"no-byte-fallback", llama2, {{"model", {{"byte_fallback", false}}}}, "model.byte_fallback"},
  };
  for (const auto& item : refused) {
    const auto directory = patched_tokenizer(temp, item.name, item.tokenizer_dir, item.patch);
    auto config = Json::parse(testing::read_text(fixture("tiny-llama/config.json")));
    const auto base = BaseDirectory::read(directory, parse_hf_config(config.dump(), directory + "/config.json"));
    const auto message = testing::error_message([&] { gguf_tokenizer_metadata(base); });
    EXPECT_NE(message.find(std::string("tokenizer.json: ") + item.key + ":"), std::string::npos) << item.name << ": " << message;
  }
}

}  // namespace
}  // namespace qtrain::trainer
