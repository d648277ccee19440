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
#include <vector>

#include "data/example.h"

namespace qtrain::data {

// Every sample must be at most max_seq_len long (Error otherwise).
std::vector<Example> pack_examples(const std::vector<Example>& samples, int64_t max_seq_len);

}  // namespace qtrain::data
