#pragma once
// Examples into [batch, seq] tensors, and the seeded, sharded, resumable order in which a
// run sees them.
#include <torch/torch.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "data/example.h"

namespace qtrain::data {

struct Batch {
  torch::Tensor input_ids;  // [batch, longest] int64, right-padded with pad_id
  torch::Tensor labels;     // [batch, longest] int64, kIgnoreLabel on padding
  // Packed batches only (else undefined): positions restarting at each sample, and which
  // sample of its row each token belongs to (-1 on padding), for block-diagonal attention.
  torch::Tensor position_ids;  // [batch, longest] int64
  torch::Tensor sample_ids;    // [batch, longest] int64
  // Preference pairs whose rows all carry reference_log_probs: [batch, 2] fp64 (else undefined).
  torch::Tensor reference_log_probs;
  int64_t input_tokens = 0;      // real (unpadded) tokens
  int64_t predicted_tokens = 0;  // labels that a next-token loss uses
};

// Rows in their order, except in a packed batch, where the rows that are one sample of the
// batch's full length come first (stable): attention takes those leading rows as one causal
// block, on faster kernels than the spans of the rest (trainer/model/flash_attention.h).
Batch collate(const std::vector<const Example*>& rows, int64_t pad_id = 0);

struct BatchStreamOptions {
  int64_t batch_size = 1;  // rows per batch, per rank
  bool shuffle = true;
  uint64_t seed = 42;  // the order of epoch e is a permutation drawn from seed + e
  int64_t pad_id = 0;
  int64_t rank = 0;  // this process's share of every global batch
  int64_t world_size = 1;
};

// Where a stream stands: the next batch it hands out, and what the order depends on, so that
// a resumed run can check it reads the same data the same way.
struct LoaderState {
  int64_t epoch = 0;
  int64_t batch_in_epoch = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t examples = 0;
  int64_t batch_size = 0;
  int64_t world_size = 1;

  nlohmann::json to_json() const;
  // Error naming `source` for a missing or mistyped field.
  static LoaderState from_json(const nlohmann::json& value, const std::string& source);
};

// Endless batches over epochs. Every epoch is one permutation of the examples, shared by all
// ranks; global batch b is its slice [b*W*B, (b+1)*W*B) and rank r takes the r-th B rows of it,
// so the ranks see disjoint examples and together every example of the epoch once. The tail
// that does not fill a global batch is left out of that epoch (it comes up in another order
// in the next). With fewer examples than one global batch, a batch holds all of them (an equal
// share per rank); fewer examples than ranks is an error.
class BatchStream {
 public:
  BatchStream(std::vector<Example> examples, const BatchStreamOptions& options);
  Batch next();
  // The rows of the next batch, uncollated (for showing them); next() collates these.
  std::vector<const Example*> next_rows();
  int64_t batches_per_epoch() const;
  // The batch size, or the examples per rank where there are fewer.
  int64_t rows_per_batch() const { return rows_per_batch_; }
  LoaderState state() const;
  // Continues from `state`; Error when it was taken over other data or with other settings.
  void restore(const LoaderState& state);
  const std::vector<Example>& examples() const { return examples_; }

 private:
  void order_epoch();
  std::vector<Example> examples_;
  BatchStreamOptions options_;
  int64_t rows_per_batch_ = 1;
  std::vector<size_t> order_;
  int64_t epoch_ = 0;
  int64_t batch_ = 0;
};

}  // namespace qtrain::data
