#include "trainer/model/softcapped_attention.h"

#include <limits>

namespace qtrain::trainer {

torch::Tensor softcapped_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                   const torch::Tensor& visible, double scale, double softcap) {
  const int64_t groups = query.size(1) / key.size(1);
  const auto keys = groups > 1 ? key.repeat_interleave(groups, 1) : key;
  const auto values = groups > 1 ? value.repeat_interleave(groups, 1) : value;
  auto scores = torch::matmul(query, keys.transpose(2, 3)) * scale;
  scores = torch::tanh(scores / softcap) * softcap;
  scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const auto probabilities = torch::softmax(scores, -1, torch::kFloat32).to(query.scalar_type());
  return torch::matmul(probabilities, values);
}

}  // namespace qtrain::trainer
