#pragma once
// Packing (data.pack): samples concatenated into windows of max_seq_len, so that batches hold
// few padding tokens. Best fit, in order: each sample goes into the open window whose free
// room it fills most closely, or starts a new one (axolotl's multipack packs by fit too; a
// sequential packer would leave the tail window of every long text document half empty,
// since the next document's first window never fits beside it). Each packed example keeps
// its samples' lengths, from which the trainer restarts positions and blocks attention at
// every boundary, and the first token of each sample is not a label (a sample never learns
// to predict itself from the one before), so a packed batch has the loss of its samples apart.
#include <cstdint>
#include <string>
#include <vector>

#include "data/example.h"

namespace qtrain::data {

// Every sample must be at most max_seq_len long (Error otherwise).
std::vector<Example> pack_examples(const std::vector<Example>& samples, int64_t max_seq_len);

// Wrapped packing (data.pack_strategy: wrapped, TRL's packing_strategy="wrapped"): samples in
// order fill each window to max_seq_len, a sample that does not fit the room left continuing at
// the start of the next window. Each piece is a sample of its own (positions restart, attention
// stays inside it, its first token is not a label), as a long document's windows are. Only the
// last window may be short. For text: an instruct or chat sample cut in two would lose its prompt.
std::vector<Example> wrap_examples(const std::vector<Example>& samples, int64_t max_seq_len);

// data.pack_strategy's values, and the packer each names (nullptr for a name that is none).
using Packer = std::vector<Example> (*)(const std::vector<Example>&, int64_t);
struct PackStrategy {
  const char* name;
  Packer pack;
  bool splits_samples;  // only for formats whose samples are windows of documents (text, tokens)
};
const std::vector<PackStrategy>& pack_strategies();
const PackStrategy* find_pack_strategy(const std::string& name);

}  // namespace qtrain::data
