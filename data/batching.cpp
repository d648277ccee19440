#include "data/batching.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "kernels/error.h"

namespace qtrain::data {

Batch collate(const std::vector<const Example*>& rows, int64_t pad_id) {
  int64_t longest = 0;
  bool packed = false;
  for (const Example* row : rows) {
    longest = std::max(longest, row->size());
    packed = packed || !row->sample_lengths.empty();
  }
  // Packed rows that are one sample end to end go first, in their order: attention runs those
  // leading rows as one causal block (trainer/model/flash_attention.h).
  std::vector<const Example*> ordered = rows;
  if (packed) {
    std::stable_partition(ordered.begin(), ordered.end(), [longest](const Example* row) {
      return row->size() == longest && row->sample_lengths.size() <= 1;
    });
  }
  const auto row_count = static_cast<int64_t>(rows.size());
  Batch batch;
  batch.input_ids = torch::full({row_count, longest}, pad_id, torch::kInt64);
  batch.labels = torch::full({row_count, longest}, kIgnoreLabel, torch::kInt64);
  if (packed) {
    batch.position_ids = torch::zeros({row_count, longest}, torch::kInt64);
    batch.sample_ids = torch::full({row_count, longest}, -1, torch::kInt64);
  }
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  for (int64_t row = 0; row < row_count; ++row) {
    const Example& example = *ordered[row];
    std::copy(example.input_ids.begin(), example.input_ids.end(), &ids[row][0]);
    std::copy(example.labels.begin(), example.labels.end(), &labels[row][0]);
    batch.input_tokens += example.size();
    batch.predicted_tokens += example.predicted_tokens();
    if (!packed) continue;
    auto positions = batch.position_ids.accessor<int64_t, 2>();
    auto samples = batch.sample_ids.accessor<int64_t, 2>();
    const std::vector<int64_t> whole = {example.size()};
    const auto& lengths = example.sample_lengths.empty() ? whole : example.sample_lengths;
    int64_t position = 0;
    for (size_t sample = 0; sample < lengths.size(); ++sample) {
      for (int64_t offset = 0; offset < lengths[sample]; ++offset, ++position) {
        positions[row][position] = offset;
        samples[row][position] = static_cast<int64_t>(sample);
      }
    }
  }
  const bool referenced = !ordered.empty() && std::all_of(ordered.begin(), ordered.end(), [](const Example* row) {
    return row->reference_log_probs.size() == 2;
  });
  if (referenced) {
    batch.reference_log_probs = torch::empty({row_count, 2}, torch::kFloat64);
    auto reference = batch.reference_log_probs.accessor<double, 2>();
    for (int64_t row = 0; row < row_count; ++row) {
      reference[row][0] = ordered[row]->reference_log_probs[0];
      reference[row][1] = ordered[row]->reference_log_probs[1];
    }
  }
  return batch;
}

nlohmann::json LoaderState::to_json() const {
  return {{"epoch", epoch},           {"batch_in_epoch", batch_in_epoch}, {"seed", seed},
          {"shuffle", shuffle},       {"examples", examples},             {"batch_size", batch_size},
          {"world_size", world_size}};
}

LoaderState LoaderState::from_json(const nlohmann::json& value, const std::string& source) {
  const auto integer = [&](const char* key) -> int64_t {
    if (!value.is_object() || !value.contains(key) || !value[key].is_number_integer()) {
      throw Error(ErrorCode::kData, source + ": the data loader state has no integer \"" + std::string(key) + "\"");
    }
    return value[key].get<int64_t>();
  };
  LoaderState state;
  state.epoch = integer("epoch");
  state.batch_in_epoch = integer("batch_in_epoch");
  state.seed = static_cast<uint64_t>(integer("seed"));
  if (!value.contains("shuffle") || !value["shuffle"].is_boolean()) {
    throw Error(ErrorCode::kData, source + ": the data loader state has no boolean \"shuffle\"");
  }
  state.shuffle = value["shuffle"].get<bool>();
  state.examples = integer("examples");
  state.batch_size = integer("batch_size");
  state.world_size = integer("world_size");
  return state;
}

BatchStream::BatchStream(std::vector<Example> examples, const BatchStreamOptions& options)
    : examples_(std::move(examples)), options_(options) {
  if (options_.batch_size < 1) throw Error(ErrorCode::kData, "batch size must be at least 1");
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size) {
    throw Error(ErrorCode::kData, "rank " + std::to_string(options_.rank) + " is outside a world of " +
                std::to_string(options_.world_size) + " processes");
  }
  const auto examples_per_rank = static_cast<int64_t>(examples_.size()) / options_.world_size;
  if (examples_per_rank == 0) {
    throw Error(ErrorCode::kData, "the training data has " + std::to_string(examples_.size()) + " examples, fewer than the " +
                std::to_string(options_.world_size) + " ranks: each rank needs at least one; add data or run on fewer ranks");
  }
  // Fewer examples than one batch: every batch holds all there are, as a loader without
  // drop_last gives them (the loss is a per-token mean, so it needs no full batch).
  rows_per_batch_ = std::min(options_.batch_size, examples_per_rank);
  order_epoch();
}

int64_t BatchStream::batches_per_epoch() const {
  return static_cast<int64_t>(examples_.size()) / (rows_per_batch_ * options_.world_size);
}

void BatchStream::order_epoch() {
  order_.resize(examples_.size());
  std::iota(order_.begin(), order_.end(), size_t{0});
  if (options_.shuffle) {
    std::mt19937_64 generator(options_.seed + static_cast<uint64_t>(epoch_));
    std::shuffle(order_.begin(), order_.end(), generator);
  }
}

LoaderState BatchStream::state() const {
  LoaderState state;
  state.epoch = epoch_;
  state.batch_in_epoch = batch_;
  state.seed = options_.seed;
  state.shuffle = options_.shuffle;
  state.examples = static_cast<int64_t>(examples_.size());
  state.batch_size = options_.batch_size;
  state.world_size = options_.world_size;
  return state;
}

void BatchStream::restore(const LoaderState& state) {
  const LoaderState mine = this->state();
  const auto differs = [](const char* what, auto saved, auto now) {
    throw Error(ErrorCode::kData, "the data loader state was saved with " + std::string(what) + " " + std::to_string(saved) +
                ", this run has " + std::to_string(now) +
                "; resume with the same data, train.seed, micro-batch size and number of processes");
  };
  if (state.examples != mine.examples) differs("examples", state.examples, mine.examples);
  if (state.seed != mine.seed) differs("seed", state.seed, mine.seed);
  if (state.shuffle != mine.shuffle) differs("shuffle", state.shuffle, mine.shuffle);
  if (state.batch_size != mine.batch_size) differs("batch size", state.batch_size, mine.batch_size);
  if (state.world_size != mine.world_size) differs("world size", state.world_size, mine.world_size);
  if (state.epoch < 0 || state.batch_in_epoch < 0 || state.batch_in_epoch > batches_per_epoch()) {
    throw Error(ErrorCode::kData, "data position (epoch " + std::to_string(state.epoch) + ", batch " +
                std::to_string(state.batch_in_epoch) + ") is outside the data (" +
                std::to_string(batches_per_epoch()) + " batches per epoch)");
  }
  epoch_ = state.epoch;
  batch_ = state.batch_in_epoch;
  order_epoch();
}

Batch BatchStream::next() { return collate(next_rows(), options_.pad_id); }

std::vector<const Example*> BatchStream::next_rows() {
  if (batch_ == batches_per_epoch()) {
    ++epoch_;
    batch_ = 0;
    order_epoch();
  }
  const auto rows_per_batch = static_cast<size_t>(rows_per_batch_);
  const size_t first = (static_cast<size_t>(batch_ * options_.world_size + options_.rank)) * rows_per_batch;
  std::vector<const Example*> rows;
  rows.reserve(rows_per_batch);
  for (size_t index = first; index < first + rows_per_batch; ++index) rows.push_back(&examples_[order_[index]]);
  ++batch_;
  return rows;
}

}  // namespace qtrain::data
