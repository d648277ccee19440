#include "data/packing.h"

#include <map>

#include "kernels/error.h"

namespace qtrain::data {

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
    const size_t start = window.input_ids.size();
    window.input_ids.insert(window.input_ids.end(), sample.input_ids.begin(), sample.input_ids.end());
    window.labels.insert(window.labels.end(), sample.labels.begin(), sample.labels.end());
    if (!sample.labels.empty()) window.labels[start] = kIgnoreLabel;
    window.sample_lengths.push_back(sample.size());
    if (window.size() < max_seq_len) room.emplace(max_seq_len - window.size(), index);
  }
  return packed;
}

}  // namespace qtrain::data
