#pragma once
// Token sequences into [batch, seq] tensors, and a seeded, resumable stream of such batches.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "data/token_sequences.h"

namespace qtrain::data {

constexpr int64_t kIgnoreLabel = -100;  // labels that take no part in the loss (transformers' value)

struct Batch {
  torch::Tensor input_ids;  // [batch, longest] int64, right-padded with pad_id
  torch::Tensor labels;     // [batch, longest] int64, kIgnoreLabel on padding
  int64_t input_tokens = 0;      // real (unpadded) tokens
  int64_t predicted_tokens = 0;  // labels that a next-token loss uses (each row's length - 1)
};

// sequences[first, last) as one right-padded batch.
Batch collate(const std::vector<TokenSequence>& sequences, size_t first, size_t last, int64_t pad_id = 0);

struct BatchStreamOptions {
  int64_t batch_size = 1;
  bool shuffle = true;
  uint64_t seed = 42;  // the order of epoch e is a permutation drawn from seed + e
  int64_t pad_id = 0;
};

// Endless batches over epochs; the last incomplete batch of an epoch is dropped, so every
// batch has batch_size rows. Its position (epoch, batch) is all it needs to resume exactly.
class BatchStream {
 public:
  BatchStream(std::vector<TokenSequence> sequences, const BatchStreamOptions& options);
  Batch next();
  int64_t batches_per_epoch() const;
  int64_t epoch() const { return epoch_; }
  int64_t batch_in_epoch() const { return batch_; }
  void seek(int64_t epoch, int64_t batch_in_epoch);

 private:
  void shuffle_epoch();
  std::vector<TokenSequence> sequences_;
  BatchStreamOptions options_;
  std::vector<size_t> order_;
  int64_t epoch_ = 0;
  int64_t batch_ = 0;
};

}  // namespace qtrain::data
