#pragma once
// A data::Batch as the model's inputs on a device. Packed batches get their positions
// restarting at every sample and attention that stays inside each sample (block-diagonal), so
// that the loss of a packed batch is the loss of its samples apart.
#include "data/batching.h"
#include "trainer/model/attention_mask.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

LlamaInputs model_inputs(const data::Batch& batch, torch::Device device,
                         PackedAttention packed_attention = PackedAttention::kSpans);

}  // namespace qtrain::trainer
