#pragma once
// Tensor comparisons the suites share.
#include <torch/torch.h>

namespace qtrain::testing {

// max |actual - expected| / max |expected|, in float64 on the CPU.
inline double max_relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  const auto expected64 = expected.to(torch::kFloat64).cpu();
  return ((actual.to(torch::kFloat64).cpu() - expected64).abs().max() / expected64.abs().max()).item<double>();
}

// Same dtype, shape and bytes.
inline bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  return torch::equal(a.cpu().contiguous().view(torch::kUInt8), b.cpu().contiguous().view(torch::kUInt8));
}

}  // namespace qtrain::testing
