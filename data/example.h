#pragma once
// What the data pipeline hands the trainer: token ids with the labels a loss learns from.
// A sample is one record (a text window, an instruction and its response, a chat); an example
// is one row of a batch: a sample, or several samples packed into one window.
#include <cstdint>
#include <vector>

namespace qtrain::data {

constexpr int64_t kIgnoreLabel = -100;  // labels that take no part in the loss (transformers' value)

struct Example {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;  // same length; the token itself where it is learned, else kIgnoreLabel
  // Packed examples: the length of each sample in order (they sum to the length); attention and
  // positions restart at every boundary. Empty: one sample.
  std::vector<int64_t> sample_lengths;
  // A preference pair (data.format preference) is two samples, the prompt with the chosen and then
  // with the rejected completion, only the completions labelled. reference_log_probs: the reference
  // model's log-probabilities of the two completions, when computed before training; else empty.
  std::vector<double> reference_log_probs;

  int64_t size() const { return static_cast<int64_t>(input_ids.size()); }
  // Labels a next-token loss uses: those after the first position that are not ignored.
  int64_t predicted_tokens() const;
};

}  // namespace qtrain::data
