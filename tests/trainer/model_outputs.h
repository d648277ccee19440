#pragma once
// What trainer tests compare models by: fp32 logits, and their largest difference relative to
// the largest reference logit.
#include <torch/torch.h>

#include "trainer/model/llama.h"

namespace qtrain::trainer::testing_outputs {

inline torch::Tensor logits_of(LlamaForCausalLMImpl& model, const torch::Tensor& input_ids) {
  torch::NoGradGuard no_grad;
  LlamaInputs inputs;
  inputs.input_ids = input_ids;
  return model.forward(inputs);
}

// max |actual - expected| / max |expected|, in double precision
inline double max_relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  auto expected64 = expected.to(torch::kFloat64);
  return ((actual.to(torch::kFloat64) - expected64).abs().max() / expected64.abs().max()).item<double>();
}

}  // namespace qtrain::trainer::testing_outputs
