#pragma once
// Parameters with fresh random values for optimiser tests, and copies of them.
#include <torch/torch.h>

#include <vector>

namespace qtrain::optim::testing {

// A [16, 8] matrix, a [31] vector and a [3, 4, 5] tensor: odd sizes, several ranks.
inline std::vector<torch::Tensor> random_parameters(torch::Dtype dtype, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> parameters;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{16, 8}, {31}, {3, 4, 5}}) {
    parameters.push_back(torch::randn(shape, torch::dtype(dtype)).requires_grad_());
  }
  return parameters;
}

inline std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& parameters, torch::Dtype dtype) {
  std::vector<torch::Tensor> copies;
  for (const auto& parameter : parameters) copies.push_back(parameter.detach().to(dtype).clone().requires_grad_());
  return copies;
}

}  // namespace qtrain::optim::testing
