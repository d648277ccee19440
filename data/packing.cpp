#include "data/packing.h"

#include <algorithm>
#include <map>
#include <utility>

#include "kernels/error.h"

namespace qtrain::data {

namespace {

// Appends samples[begin, begin + count) to `window` as a sample of its own.
void append_piece(Example& window, const Example& sample, int64_t begin, int64_t count) {
  const size_t start = window.input_ids.size();
  window.input_ids.insert(window.input_ids.end(), sample.input_ids.begin() + begin, sample.input_ids.begin() + begin + count);
  if (!sample.labels.empty()) {
    window.labels.insert(window.labels.end(), sample.labels.begin() + begin, sample.labels.begin() + begin + count);
    window.labels[start] = kIgnoreLabel;
  }
  window.sample_lengths.push_back(count);
}

}  // namespace

std::vector<Example> wrap_examples(const std::vector<Example>& samples, int64_t max_seq_len) {
  std::vector<Example> packed;
  Example window;
  for (const Example& sample : samples) {
    for (int64_t begin = 0; begin < sample.size();) {
      const int64_t count = std::min(max_seq_len - window.size(), sample.size() - begin);
      append_piece(window, sample, begin, count);
      begin += count;
      if (window.size() == max_seq_len) packed.push_back(std::exchange(window, Example{}));
    }
  }
  if (window.size() > 0) packed.push_back(std::move(window));
  return packed;
}

const std::vector<PackStrategy>& pack_strategies() {
  static const std::vector<PackStrategy> strategies = {
      {"best_fit", pack_examples, false},
      {"wrapped", wrap_examples, true},
  };
  return strategies;
}

const PackStrategy* find_pack_strategy(const std::string& name) {
  for (const auto& strategy : pack_strategies()) {
    if (name == strategy.name) return &strategy;
  }
  return nullptr;
}

std::vector<Example> pack_examples(const std::vector<Example>& samples, int64_t max_seq_len) {
  std::vector<Example> packed;
  std::multimap<int64_t, size_t> room;  // free tokens -> window, for windows with any room left
  for (const Example& sample : samples) {
    if (sample.size() > max_seq_len) {
      throw Error(ErrorCode::kData, "packing: a sample of " + std::to_string(sample.size()) + " tokens is longer than data.max_seq_len " +
                  std::to_string(max_seq_len));
    }
    size_t index = packed.size();
    const auto fit = room.lower_bound(sample.size());
    if (fit != room.end()) {
      index = fit->second;
      room.erase(fit);
    } else {
      packed.emplace_back();
    }
    Example& window = packed[index];
    append_piece(window, sample, 0, sample.size());
    if (window.size() < max_seq_len) room.emplace(max_seq_len - window.size(), index);
  }
  return packed;
}

}  // namespace qtrain::data
