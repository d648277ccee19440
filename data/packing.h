#pragma once
// Packing (data.pack): samples concatenated into windows of max_seq_len, so that batches hold
// few padding tokens. Greedy and in order, like torchtune's PackedDataset without splitting: a
// sample that does not fit the current window starts the next one. Each packed example keeps
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
