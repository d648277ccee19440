#include "data/batching.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "kernels/error.h"

namespace qtrain::data {

Batch collate(const std::vector<TokenSequence>& sequences, size_t first, size_t last, int64_t pad_id) {
  size_t longest = 0;
  for (size_t index = first; index < last; ++index) longest = std::max(longest, sequences[index].size());
  const auto rows = static_cast<int64_t>(last - first);
  Batch batch;
  batch.input_ids = torch::full({rows, static_cast<int64_t>(longest)}, pad_id, torch::kInt64);
  batch.labels = torch::full({rows, static_cast<int64_t>(longest)}, kIgnoreLabel, torch::kInt64);
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  for (size_t row = 0; row < last - first; ++row) {
    const auto& sequence = sequences[first + row];
    for (size_t position = 0; position < sequence.size(); ++position) {
      ids[row][position] = sequence[position];
      labels[row][position] = sequence[position];
    }
    batch.input_tokens += static_cast<int64_t>(sequence.size());
    batch.predicted_tokens += std::max<int64_t>(static_cast<int64_t>(sequence.size()) - 1, 0);
  }
  return batch;
}

BatchStream::BatchStream(std::vector<TokenSequence> sequences, const BatchStreamOptions& options)
    : sequences_(std::move(sequences)), options_(options) {
  if (options_.batch_size < 1) throw Error("batch size must be at least 1");
  if (static_cast<int64_t>(sequences_.size()) < options_.batch_size) {
    throw Error("the training data has " + std::to_string(sequences_.size()) +
                " sequences, fewer than one batch of " + std::to_string(options_.batch_size));
  }
  shuffle_epoch();
}

int64_t BatchStream::batches_per_epoch() const {
  return static_cast<int64_t>(sequences_.size()) / options_.batch_size;
}

void BatchStream::shuffle_epoch() {
  order_.resize(sequences_.size());
  std::iota(order_.begin(), order_.end(), size_t{0});
  if (options_.shuffle) {
    std::mt19937_64 generator(options_.seed + static_cast<uint64_t>(epoch_));
    std::shuffle(order_.begin(), order_.end(), generator);
  }
}

void BatchStream::seek(int64_t epoch, int64_t batch_in_epoch) {
  if (epoch < 0 || batch_in_epoch < 0 || batch_in_epoch >= batches_per_epoch()) {
    throw Error("data position (epoch " + std::to_string(epoch) + ", batch " + std::to_string(batch_in_epoch) +
                ") is outside the data (" + std::to_string(batches_per_epoch()) + " batches per epoch)");
  }
  epoch_ = epoch;
  batch_ = batch_in_epoch;
  shuffle_epoch();
}

Batch BatchStream::next() {
  if (batch_ == batches_per_epoch()) {
    ++epoch_;
    batch_ = 0;
    shuffle_epoch();
  }
  std::vector<TokenSequence> rows;
  rows.reserve(static_cast<size_t>(options_.batch_size));
  const auto first = static_cast<size_t>(batch_ * options_.batch_size);
  for (size_t index = first; index < first + static_cast<size_t>(options_.batch_size); ++index) {
    rows.push_back(sequences_[order_[index]]);
  }
  ++batch_;
  return collate(rows, 0, rows.size(), options_.pad_id);
}

}  // namespace qtrain::data
