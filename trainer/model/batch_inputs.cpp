#include "trainer/model/batch_inputs.h"

namespace qtrain::trainer {

LlamaInputs model_inputs(const data::Batch& batch, torch::Device device, PackedAttention packed_attention) {
  LlamaInputs inputs;
  inputs.input_ids = batch.input_ids.to(device);
  if (batch.input_ids.device().is_cpu()) inputs.host_input_ids = batch.input_ids;
  if (batch.sample_ids.defined()) {
    inputs.position_ids = batch.position_ids.to(device);
    inputs.attention_mask = AttentionMask::packed(batch.sample_ids, device, packed_attention);
  }
  return inputs;
}

}  // namespace qtrain::trainer
