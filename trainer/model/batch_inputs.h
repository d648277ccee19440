#pragma once
// A data::Batch as the model's inputs on a device. Packed batches get their positions
// restarting at every sample and a block-diagonal causal mask, so that no token attends across
// a sample boundary (the loss of a packed batch is the loss of its samples apart).
#include "data/batching.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

// [batch, 1, seq, seq] bool, true where query i may attend to key j: j <= i and both tokens
// belong to the same sample (sample_ids [batch, seq]).
torch::Tensor block_causal_mask(const torch::Tensor& sample_ids);

LlamaInputs model_inputs(const data::Batch& batch, torch::Device device);

}  // namespace qtrain::trainer
