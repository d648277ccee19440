#include "trainer/model/batch_inputs.h"

namespace qtrain::trainer {

torch::Tensor block_causal_mask(const torch::Tensor& sample_ids) {
  const int64_t sequence = sample_ids.size(1);
  const auto causal = torch::ones({sequence, sequence}, sample_ids.options().dtype(torch::kBool)).tril();
  const auto same_sample = sample_ids.unsqueeze(2) == sample_ids.unsqueeze(1);  // [batch, seq, seq]
  return (same_sample & causal).unsqueeze(1);
}

LlamaInputs model_inputs(const data::Batch& batch, torch::Device device) {
  LlamaInputs inputs;
  inputs.input_ids = batch.input_ids.to(device);
  if (batch.sample_ids.defined()) {
    inputs.position_ids = batch.position_ids.to(device);
    inputs.attention_mask = block_causal_mask(batch.sample_ids.to(device));
  }
  return inputs;
}

}  // namespace qtrain::trainer
