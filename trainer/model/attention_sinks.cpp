#include "trainer/model/attention_sinks.h"

#include <limits>

namespace qtrain::trainer {

torch::Tensor sink_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                             const torch::Tensor& visible, double scale, const torch::Tensor& sinks) {
  const int64_t groups = query.size(1) / key.size(1);  // keys and values repeated to every query head
  const auto keys = groups == 1 ? key : key.repeat_interleave(groups, 1);
  const auto values = groups == 1 ? value : value.repeat_interleave(groups, 1);
  auto scores = torch::matmul(query, keys.transpose(2, 3)) * scale;
  // transformers adds the dtype's lowest value where a key is hidden: after the max is subtracted
  // its weight is 0, as -inf's is (the sink's column keeps every row's max finite).
  scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const auto sink_column = sinks.to(scores.scalar_type()).view({1, -1, 1, 1}).expand({scores.size(0), -1, scores.size(2), 1});
  auto combined = torch::cat({scores, sink_column}, -1);
  combined = combined - std::get<0>(combined.max(-1, /*keepdim=*/true));
  const auto probabilities = torch::softmax(combined, -1, combined.scalar_type());
  return torch::matmul(probabilities.narrow(-1, 0, scores.size(-1)), values);
}

}  // namespace qtrain::trainer
