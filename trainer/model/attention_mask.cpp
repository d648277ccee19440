#include "trainer/model/attention_mask.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "kernels/error.h"

namespace qtrain::trainer {

torch::Tensor block_causal_mask(const torch::Tensor& sample_ids) {
  const int64_t sequence = sample_ids.size(1);
  const auto causal = torch::ones({sequence, sequence}, sample_ids.options().dtype(torch::kBool)).tril();
  const auto same_sample = sample_ids.unsqueeze(2) == sample_ids.unsqueeze(1);  // [batch, seq, seq]
  return (same_sample & causal).unsqueeze(1);
}

SampleSpans sample_spans(const torch::Tensor& sample_ids) {
  if (sample_ids.dim() != 2 || sample_ids.scalar_type() != torch::kInt64) {
    throw Error(ErrorCode::kInternal, "sample_spans: sample ids must be int64 [batch, seq], got " +
                                          std::string(c10::toString(sample_ids.scalar_type())) + " with " +
                                          std::to_string(sample_ids.dim()) + " dimensions");
  }
  const auto ids = sample_ids.to(torch::kCPU).contiguous();
  const int64_t rows = ids.size(0), sequence = ids.size(1);
  if (rows * sequence > std::numeric_limits<int32_t>::max()) {
    throw Error(ErrorCode::kRecipe, "packed attention: a batch of " + std::to_string(rows * sequence) +
                                        " tokens is beyond flash attention's 32-bit offsets; use fewer rows per micro-batch");
  }
  const auto accessor = ids.accessor<int64_t, 2>();
  std::vector<int32_t> ends = {0};
  SampleSpans spans;
  spans.tokens = rows * sequence;
  bool leading = true;  // every row so far one sample end to end
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t position = 0; position < sequence; ++position) {
      const bool run_ends = position + 1 == sequence || accessor[row][position + 1] != accessor[row][position];
      if (!run_ends) continue;
      const auto end = static_cast<int32_t>(row * sequence + position + 1);
      const int64_t length = end - ends.back();
      spans.longest = std::max<int64_t>(spans.longest, length);
      if (!leading || length < sequence || accessor[row][0] < 0) {
        leading = false;
        spans.rest_longest = std::max<int64_t>(spans.rest_longest, length);
      }
      ends.push_back(end);
    }
    if (leading) spans.whole_rows = row + 1;
  }
  spans.cumulative_lengths = torch::tensor(ends, torch::kInt32);
  spans.run_bounds = torch::empty({2, spans.tokens}, torch::kInt32);
  auto* starts = spans.run_bounds.data_ptr<int32_t>();
  for (size_t run = 1; run < ends.size(); ++run) {
    std::fill(starts + ends[run - 1], starts + ends[run], ends[run - 1]);
    std::fill(starts + spans.tokens + ends[run - 1], starts + spans.tokens + ends[run], ends[run]);
  }
  if (spans.whole_rows < rows) {
    // Each whole row is one run: the rest's runs start at ends[whole_rows].
    const auto offset = static_cast<int32_t>(spans.whole_rows * sequence);
    std::vector<int32_t> rest(ends.begin() + spans.whole_rows, ends.end());
    for (auto& end : rest) end -= offset;
    spans.rest_cumulative_lengths = torch::tensor(rest, torch::kInt32);
  }
  return spans;
}

AttentionMask AttentionMask::written_out(torch::Tensor mask) {
  AttentionMask result;
  if (!mask.defined()) return result;
  result.state_ = std::make_shared<State>();
  result.state_->mask = std::move(mask);
  return result;
}

AttentionMask AttentionMask::packed(const torch::Tensor& sample_ids, const torch::Device& device, PackedAttention how) {
  AttentionMask result;
  result.state_ = std::make_shared<State>();
  result.state_->sample_ids = sample_ids;  // to the device only if the mask is written out
  result.state_->device = device;
  if (how == PackedAttention::kSpans) {
    result.state_->spans = sample_spans(sample_ids);
    auto& spans = result.state_->spans;
    // The int32 tables go to the device in one copy (each micro-batch makes one), then as views.
    std::vector<torch::Tensor*> tables = {&spans.cumulative_lengths, &spans.run_bounds};
    if (spans.rest_cumulative_lengths.defined()) tables.push_back(&spans.rest_cumulative_lengths);
    std::vector<torch::Tensor> flat;
    for (const auto* table : tables) flat.push_back(table->reshape(-1));
    const auto joined = torch::cat(flat).to(device);
    int64_t offset = 0;
    for (auto* table : tables) {
      *table = joined.narrow(0, offset, table->numel()).view(table->sizes());
      offset += table->numel();
    }
  }
  return result;
}

const torch::Tensor& AttentionMask::dense() const {
  static const torch::Tensor none;
  if (!state_) return none;
  if (!state_->mask.defined()) state_->mask = block_causal_mask(state_->sample_ids.to(state_->device));
  return state_->mask;
}

const SampleSpans* AttentionMask::spans() const {
  return state_ && state_->spans.cumulative_lengths.defined() ? &state_->spans : nullptr;
}

}  // namespace qtrain::trainer
