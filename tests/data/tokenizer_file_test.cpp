// The streamed read of tokenizer.json against nlohmann's plain parse of the same file: the
// streamed document is the parse less model.vocab and model.merges, which are in the tables.
#include "data/tokenizer_file.h"

#include <gtest/gtest.h>

#include <deque>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kernels/error.h"
#include "support.h"
#include "json_support.h"

namespace qtrain::data {
namespace {

using testing::read_json;
void expect_equal_to_full_parse(const std::string& path) {
  const nlohmann::json full = read_json(path);
  const TokenizerFile streamed = read_tokenizer_file(path);

  nlohmann::json rest = full;
  rest["model"]["vocab"] = nlohmann::json::object();
  rest["model"]["merges"] = nlohmann::json::array();
  EXPECT_EQ(streamed.document, rest) << path;

  const auto vocab = full["model"]["vocab"].get<std::map<std::string, int64_t>>();
  const std::map<std::string, int64_t> streamed_vocab(streamed.tables.vocab.begin(), streamed.tables.vocab.end());
  EXPECT_EQ(streamed_vocab, vocab) << path;
  ASSERT_EQ(streamed.tables.merges.size(), full["model"]["merges"].size()) << path;
  for (size_t rank = 0; rank < streamed.tables.merges.size(); ++rank) {
    const nlohmann::json& merge = full["model"]["merges"][rank];
    std::pair<std::string, std::string> expected;
    if (merge.is_string()) {
      const std::string line = merge.get<std::string>();
      expected = {line.substr(0, line.find(' ')), line.substr(line.find(' ') + 1)};
    } else {
      expected = merge.get<std::pair<std::string, std::string>>();
    }
    ASSERT_EQ(streamed.tables.merges[rank], expected) << path << " merge " << rank;
  }
}

TEST(TokenizerFile, StreamedReadEqualsAFullParse) {
  expect_equal_to_full_parse(qtrain::testing::fixture("tiny-llama/tokenizer.json"));
  expect_equal_to_full_parse(qtrain::testing::source_dir() + "/tests/data/sentencepiece/llama2/tokenizer.json");
}

TEST(TokenizerFile, MergeLinesAndEscapesAreRead) {
  qtrain::testing::TempDir scratch;
  const std::string path = scratch.write("tokenizer.json", R"({
    "normalizer": {"type": "Replace", "pattern": {"String": "\u0020"}, "content": "\u2581"},
    "model": {"type": "BPE", "vocab": {"a": 0, "\"b\\": 1, "a\"b\\": 2, "\ud83d\ude00": 3},
              "merges": ["a \"b\\"], "dropout": null},
    "extra": [1, -2, 0.5, true, null, {"nested": ["x"]}]})");
  const TokenizerFile file = read_tokenizer_file(path);
  const std::deque<std::pair<std::string, int64_t>> vocab = {{"a", 0}, {"\"b\\", 1}, {"a\"b\\", 2}, {"\xF0\x9F\x98\x80", 3}};
  EXPECT_EQ(file.tables.vocab, vocab);
  ASSERT_EQ(file.tables.merges.size(), 1u);
  EXPECT_EQ(file.tables.merges[0], std::make_pair(std::string("a"), std::string("\"b\\")));
  EXPECT_EQ(file.document["normalizer"]["content"], "\u2581");
  EXPECT_EQ(file.document["extra"], nlohmann::json::parse(R"([1, -2, 0.5, true, null, {"nested": ["x"]}])"));
  EXPECT_TRUE(file.document["model"]["dropout"].is_null());
}

// Vocab and merges that are not an object and an array stay in the document, for the BPE
// model to refuse by name (Tokenizer.MalformedFilesAreErrorsNamingTheFile).
TEST(TokenizerFile, VocabAndMergesOfOtherTypesStayInTheDocument) {
  qtrain::testing::TempDir scratch;
  const TokenizerFile file =
      read_tokenizer_file(scratch.write("tokenizer.json", R"({"model": {"vocab": [["a", 0]], "merges": {"a": 1}}})"));
  EXPECT_EQ(file.document["model"]["vocab"], nlohmann::json::parse(R"([["a", 0]])"));
  EXPECT_EQ(file.document["model"]["merges"], nlohmann::json::parse(R"({"a": 1})"));
  EXPECT_TRUE(file.tables.vocab.empty());
  EXPECT_TRUE(file.tables.merges.empty());
}

TEST(TokenizerFile, BadEntriesAreErrorsNamingTheKey) {
  qtrain::testing::TempDir scratch;
  auto error_of = [&](const std::string& text) -> std::string {
    try {
      read_tokenizer_file(scratch.write("tokenizer.json", text));
    } catch (const qtrain::Error& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(error_of(R"({"model": {"vocab": {"a": 0, "b": 1.5}}})").find("model.vocab[\"b\"] must be an integer, got number"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"vocab": {"a": [0]}}})").find("model.vocab[\"a\"] must be an integer, got array"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"merges": ["a b", "a  b"]}})").find("model.merges[1] must be two tokens separated by one space"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"merges": [["a", "b", "c"]]}})").find("model.merges[0] must be \"left right\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"merges": [["a"], 3]}})").find("model.merges[0]"), std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"merges": [{"a": "b"}]}})").find("model.merges[0]"), std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"vocab": {"a": 0}})").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"vocab": {"a": 0}})").find(scratch.file("tokenizer.json")), std::string::npos);
}

}  // namespace
}  // namespace qtrain::data
