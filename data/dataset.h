#pragma once
// A recipe's `data` section made into examples: the files of each source (a file, or a
// directory of shards), their records turned into samples by format, samples cut to
// max_seq_len, the sources mixed by weight, and the samples packed when asked.
//
// Long samples: a text document (and a document of a token file) longer than max_seq_len is
// cut into consecutive windows, so every token is learned; an instruct or chat sample is
// truncated to its first max_seq_len tokens or dropped (data.overlong), and one left with no
// learned token is dropped. The counts are in DataStats.
#include <cstdint>
#include <string>
#include <vector>

#include "data/example.h"
#include "data/sample_formats.h"
#include "data/tokenizer.h"

namespace qtrain::data {

struct DataOptions {
  SampleFormatOptions records;  // records.format: text | instruct | chat | tokens
  int64_t max_seq_len = 2048;
  std::string overlong = "truncate";  // truncate | drop
  bool pack = false;
  std::string pack_strategy = "best_fit";  // data/packing.h's pack_strategies()
  bool skip_bad_records = false;  // count and skip malformed records instead of stopping
  std::vector<double> weights;    // one per source: its share of the mixture; empty: every sample once
  uint64_t seed = 42;             // draws the mixture
};

struct DataStats {
  int64_t files = 0;
  int64_t records = 0;  // JSONL records, .txt files and token-file documents read
  int64_t bad_records = 0;
  std::vector<std::string> bad_record_messages;  // the first few, for the report
  int64_t split_documents = 0;  // text documents cut into several windows
  int64_t truncated = 0;
  int64_t dropped = 0;
  int64_t samples = 0;   // after cutting, dropping and mixing
  int64_t examples = 0;  // rows: samples, or packed windows
  int64_t tokens = 0;
  int64_t learned_tokens = 0;  // labels a next-token loss uses
};

struct Dataset {
  std::vector<Example> examples;
  DataStats stats;
};

// `sources` are files or directories (their *.jsonl, *.txt with format text, or *.bin with
// format tokens, in name order). model_dir holds the chat template (format chat).
Dataset load_dataset(const std::vector<std::string>& sources, const DataOptions& options, const Tokenizer& tokenizer,
                     const std::string& model_dir);

// One line for the log: "1,234 samples from 3 files (12 truncated, ...) -> 300 packed windows".
std::string describe(const DataStats& stats);

}  // namespace qtrain::data
