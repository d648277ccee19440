#pragma once
// What trainer tests compare models by: fp32 logits, and their largest difference relative to
// the largest reference logit.
#include <torch/torch.h>

#include "tensor_support.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer::testing_outputs {

inline torch::Tensor logits_of(LlamaForCausalLMImpl& model, const torch::Tensor& input_ids) {
  torch::NoGradGuard no_grad;
  LlamaInputs inputs;
  inputs.input_ids = input_ids;
  return model.forward(inputs);
}

using qtrain::testing::max_relative_error;

}  // namespace qtrain::trainer::testing_outputs
