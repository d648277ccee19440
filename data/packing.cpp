#include "data/packing.h"

#include "kernels/error.h"

namespace qtrain::data {

std::vector<Example> pack_examples(const std::vector<Example>& samples, int64_t max_seq_len) {
  std::vector<Example> packed;
  for (const Example& sample : samples) {
    if (sample.size() > max_seq_len) {
      throw Error("packing: a sample of " + std::to_string(sample.size()) + " tokens is longer than data.max_seq_len " +
                  std::to_string(max_seq_len));
    }
    if (packed.empty() || packed.back().size() + sample.size() > max_seq_len) packed.emplace_back();
    Example& window = packed.back();
    const size_t start = window.input_ids.size();
    window.input_ids.insert(window.input_ids.end(), sample.input_ids.begin(), sample.input_ids.end());
    window.labels.insert(window.labels.end(), sample.labels.begin(), sample.labels.end());
    if (!sample.labels.empty()) window.labels[start] = kIgnoreLabel;
    window.sample_lengths.push_back(sample.size());
  }
  return packed;
}

}  // namespace qtrain::data
