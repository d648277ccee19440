// A data section into examples: sources (files, directories of shards, .txt, token files),
// cutting to max_seq_len, mixing by weight, packing, and the handling of bad records.
#include "data/dataset.h"
#include "data/packing.h"

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include "data/token_file.h"
#include "kernels/error.h"
#include "support.h"

namespace qtrain::data {
namespace {

using qtrain::testing::TempDir;

std::string model_dir() { return qtrain::testing::fixture("tiny-llama"); }

const Tokenizer& tokenizer() {
  static const Tokenizer value = Tokenizer::from_model_dir(model_dir());
  return value;
}

std::string text_lines(const std::vector<std::string>& texts) {
  std::string lines;
  for (const auto& text : texts) lines += nlohmann::json{{"text", text}}.dump() + "\n";
  return lines;
}

DataOptions options_for(const std::string& format, int64_t max_seq_len = 2048) {
  DataOptions options;
  options.records.format = format;
  options.max_seq_len = max_seq_len;
  return options;
}

Dataset load(const std::vector<std::string>& sources, const DataOptions& options) {
  return load_dataset(sources, options, tokenizer(), model_dir());
}

std::string error_of(const std::vector<std::string>& sources, const DataOptions& options) {
  try {
    load(sources, options);
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

TEST(Dataset, DirectoriesOfShardsAreReadInNameOrderWithTxtFiles) {
  TempDir dir;
  dir.write("shards/b.jsonl", text_lines({"second"}));
  dir.write("shards/a.jsonl", text_lines({"first"}));
  dir.write("shards/nested/c.txt", "third, a whole file");
  dir.write("shards/.hidden.jsonl", text_lines({"never"}));
  dir.write("shards/notes.md", "not data");
  const auto dataset = load({dir.file("shards")}, options_for("text"));
  ASSERT_EQ(dataset.examples.size(), 3u);
  EXPECT_EQ(dataset.stats.files, 3);
  EXPECT_EQ(tokenizer().decode(dataset.examples[0].input_ids), "<|begin_of_text|>first<|eot_id|>");
  EXPECT_EQ(tokenizer().decode(dataset.examples[2].input_ids), "<|begin_of_text|>third, a whole file<|eot_id|>");
}

TEST(Dataset, TextDocumentsAreCutIntoWindowsAndInstructSamplesTruncatedOrDropped) {
  TempDir dir;
  std::string long_text;
  for (int i = 0; i < 40; ++i) long_text += "The jury praised the city. ";
  const auto text = load({dir.write("t.jsonl", text_lines({long_text}))}, options_for("text", 64));
  int64_t tokens = 0;
  for (const auto& example : text.examples) {
    EXPECT_LE(example.size(), 64);
    tokens += example.size();
  }
  EXPECT_EQ(tokens, static_cast<int64_t>(tokenizer().encode(long_text).size()) + 1);  // every token, plus EOS
  EXPECT_EQ(text.stats.split_documents, 1);

  const std::string record =
      nlohmann::json{{"instruction", long_text}, {"output", "Yes."}}.dump() + "\n" +
      nlohmann::json{{"instruction", "Short?"}, {"output", long_text}}.dump() + "\n";
  const auto path = dir.write("i.jsonl", record);
  auto options = options_for("instruct", 64);
  const auto truncated = load({path}, options);
  // The first loses its response to truncation, so nothing in it would be learned: dropped.
  EXPECT_EQ(truncated.examples.size(), 1u);
  EXPECT_EQ(truncated.stats.truncated, 2);
  EXPECT_EQ(truncated.stats.dropped, 1);
  EXPECT_EQ(truncated.examples[0].size(), 64);
  options.overlong = "drop";
  EXPECT_NE(error_of({path}, options).find("no usable samples"), std::string::npos);
}

TEST(Dataset, MalformedRecordsStopWithFileAndLineUnlessSkipped) {
  TempDir dir;
  const auto path = dir.write("bad.jsonl", text_lines({"good"}) + "{not json\n" + "{\"title\": \"x\"}\n" +
                                               text_lines({"also good"}));
  const std::string message = error_of({path}, options_for("text"));
  EXPECT_NE(message.find(path + ":2"), std::string::npos) << message;
  auto options = options_for("text");
  options.skip_bad_records = true;
  const auto dataset = load({path}, options);
  EXPECT_EQ(dataset.examples.size(), 2u);
  EXPECT_EQ(dataset.stats.bad_records, 2);
  ASSERT_EQ(dataset.stats.bad_record_messages.size(), 2u);
  EXPECT_NE(dataset.stats.bad_record_messages[1].find(path + ":3"), std::string::npos);
}

TEST(Dataset, EmptyAndMissingSourcesAreClearErrors) {
  TempDir dir;
  EXPECT_NE(error_of({dir.write("empty.jsonl", "\n")}, options_for("text")).find("no usable samples"),
            std::string::npos);
  EXPECT_NE(error_of({dir.file("missing.jsonl")}, options_for("text")).find("no such file"), std::string::npos);
  dir.write("only-md/readme.md", "x");
  EXPECT_NE(error_of({dir.file("only-md")}, options_for("chat")).find("*.jsonl"), std::string::npos);
}

TEST(Dataset, WeightsSetEachSourcesShareOfTheMixture) {
  TempDir dir;
  std::vector<std::string> a, b;
  for (int i = 0; i < 30; ++i) a.push_back("a" + std::to_string(i));
  for (int i = 0; i < 10; ++i) b.push_back("b" + std::to_string(i));
  auto options = options_for("text");
  options.weights = {1, 3};
  const auto dataset = load({dir.write("a.jsonl", text_lines(a)), dir.write("b.jsonl", text_lines(b))}, options);
  ASSERT_EQ(dataset.examples.size(), 40u);  // 10 from a, 30 from b: b's 10 samples three times each
  std::map<std::string, int> seen;
  for (const auto& example : dataset.examples) ++seen[tokenizer().decode(example.input_ids)];
  int from_a = 0;
  for (const auto& [text, count] : seen) {
    if (text.find(">a") != std::string::npos) {
      ++from_a;
      EXPECT_EQ(count, 1) << text;
    } else {
      EXPECT_EQ(count, 3) << text;
    }
  }
  EXPECT_EQ(from_a, 10);
  options.weights = {1};
  EXPECT_NE(error_of({dir.file("a.jsonl"), dir.file("b.jsonl")}, options).find("data.weights"), std::string::npos);
}

TEST(Dataset, PackingFillsWindowsAndKeepsSampleBoundaries) {
  TempDir dir;
  std::vector<std::string> texts;
  for (int i = 0; i < 20; ++i) texts.push_back(std::string(static_cast<size_t>(i % 5 + 1), 'x') + " the jury");
  const auto path = dir.write("t.jsonl", text_lines(texts));
  auto options = options_for("text", 32);
  const auto plain = load({path}, options);
  options.pack = true;
  const auto packed = load({path}, options);
  EXPECT_LT(packed.examples.size(), plain.examples.size());
  EXPECT_EQ(packed.stats.samples, 20);
  std::vector<std::vector<int64_t>> unpacked;
  for (const auto& window : packed.examples) {
    EXPECT_LE(window.size(), 32);
    int64_t start = 0;
    for (const int64_t length : window.sample_lengths) {
      unpacked.emplace_back(window.input_ids.begin() + start, window.input_ids.begin() + start + length);
      EXPECT_EQ(window.labels[start], kIgnoreLabel);  // never predicted from the sample before
      start += length;
    }
    EXPECT_EQ(start, window.size());
  }
  std::vector<std::vector<int64_t>> original;
  for (const auto& example : plain.examples) original.push_back(example.input_ids);
  std::sort(unpacked.begin(), unpacked.end());
  std::sort(original.begin(), original.end());
  EXPECT_EQ(unpacked, original);  // every sample exactly once
}

TEST(Dataset, PackingFillsTheTailWindowsOfLongDocuments) {
  TempDir dir;
  std::vector<std::string> texts;
  for (int i = 0; i < 6; ++i) texts.push_back(std::string(60, 'a' + i) + " and then the jury.");
  auto options = options_for("text", 16);
  options.pack = true;
  const auto packed = load({dir.write("t.jsonl", text_lines(texts))}, options);
  int64_t full = 0;
  for (const auto& window : packed.examples) full += window.size() == 16;
  // Only the last window may be short when tails fit together.
  EXPECT_GE(full + 2, static_cast<int64_t>(packed.examples.size()));
  EXPECT_LT(packed.stats.examples, packed.stats.samples);
}

// data.pack_strategy: wrapped fills every window but the last to max_seq_len: the documents'
// tokens in order, each piece a sample whose first token is not a label, the rest labelled as
// before. Best fit leaves the tails of documents half a window short where two do not fit together.
TEST(Dataset, WrappedPackingFillsEveryWindowButTheLast) {
  TempDir dir;
  std::vector<std::string> texts;
  for (int i = 0; i < 9; ++i) texts.push_back(std::string(static_cast<size_t>(7 * i + 30), 'a' + i) + " the jury said.");
  const auto path = dir.write("t.jsonl", text_lines(texts));
  auto options = options_for("text", 16);
  const auto plain = load({path}, options);
  options.pack = true;
  const auto best_fit = load({path}, options);
  options.pack_strategy = "wrapped";
  const auto wrapped = load({path}, options);
  std::vector<int64_t> stream, stream_labels;
  for (const auto& sample : plain.examples) {
    stream.insert(stream.end(), sample.input_ids.begin(), sample.input_ids.end());
    stream_labels.insert(stream_labels.end(), sample.labels.begin(), sample.labels.end());
  }
  const auto total = static_cast<int64_t>(stream.size());
  ASSERT_EQ(wrapped.examples.size(), static_cast<size_t>((total + 15) / 16));
  EXPECT_LE(wrapped.examples.size(), best_fit.examples.size());
  std::vector<int64_t> unwrapped;
  size_t at = 0;
  int64_t pieces = 0;
  for (size_t w = 0; w < wrapped.examples.size(); ++w) {
    const auto& window = wrapped.examples[w];
    if (w + 1 < wrapped.examples.size()) EXPECT_EQ(window.size(), 16);
    int64_t start = 0;
    for (const int64_t length : window.sample_lengths) {
      ASSERT_GT(length, 0);
      EXPECT_EQ(window.labels[start], kIgnoreLabel);
      for (int64_t i = 1; i < length; ++i) EXPECT_EQ(window.labels[start + i], stream_labels[at + i]);
      at += static_cast<size_t>(length);
      start += length;
      ++pieces;
    }
    EXPECT_EQ(start, window.size());
    unwrapped.insert(unwrapped.end(), window.input_ids.begin(), window.input_ids.end());
  }
  EXPECT_EQ(unwrapped, stream);  // every token once, in order
  EXPECT_GT(pieces, static_cast<int64_t>(plain.examples.size()));  // some samples continue in the next window
  EXPECT_EQ(wrapped.stats.tokens, total);
  // Tails of 10 tokens: no two fit one window of 16, so best fit leaves each 6 short.
  std::vector<Example> tails;
  for (const int64_t length : {16, 10, 16, 10, 16, 10}) {
    Example sample;
    sample.input_ids.assign(static_cast<size_t>(length), 5);
    sample.labels = sample.input_ids;
    tails.push_back(sample);
  }
  EXPECT_EQ(pack_examples(tails, 16).size(), 6u);
  EXPECT_EQ(wrap_examples(tails, 16).size(), 5u);  // 78 tokens
}

TEST(Dataset, WrappedPackingRefusesInstructAndChatSamples) {
  TempDir dir;
  const auto path = dir.write("i.jsonl", nlohmann::json{{"instruction", "Why?"}, {"output", "Because."}}.dump() + "\n");
  auto options = options_for("instruct", 64);
  options.pack = true;
  options.pack_strategy = "wrapped";
  const auto error = error_of({path}, options);
  EXPECT_NE(error.find("data.pack_strategy: wrapped"), std::string::npos) << error;
  EXPECT_NE(error.find("data.format text or tokens"), std::string::npos) << error;
  options.pack_strategy = "bfd";
  EXPECT_NE(error_of({path}, options).find("best_fit, wrapped"), std::string::npos);
}

TEST(Dataset, TokenFilesAreCutIntoDocumentsAtBos) {
  TempDir dir;
  const auto first = tokenizer().encode("One document.");
  const auto second = tokenizer().encode("And another one.");
  std::vector<int64_t> stream = first;
  stream.insert(stream.end(), second.begin(), second.end());
  const auto path = dir.write("tokens/part-0.bin", encode_token_file(stream, tokenizer().vocab_size()));
  const auto dataset = load({dir.file("tokens")}, options_for("tokens"));
  ASSERT_EQ(dataset.examples.size(), 2u);
  EXPECT_EQ(dataset.examples[0].input_ids, first);
  EXPECT_EQ(dataset.examples[1].labels, second);
  EXPECT_EQ(dataset.stats.records, 2);
  EXPECT_EQ(path, dir.file("tokens/part-0.bin"));
}

}  // namespace
}  // namespace qtrain::data
