#pragma once
// Activation checkpointing: run a piece of the model without keeping what autograd would save
// for backward, and run it again during backward to get those activations back. Memory falls
// from every layer's activations to one layer's at a time, for one extra forward per piece.
//
// The recomputation sees the random state the first run saw (CPU and the device's generator),
// so dropout masks match and gradients equal those without checkpointing. Frozen 4-bit bases
// dequantize again in the recomputation; nothing dequantized is kept in between.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "trainer/model/activation_offload.h"

namespace qtrain::trainer {

using CheckpointedFunction = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

// function(inputs), with its activations recomputed in backward. Gradients flow to `inputs`
// that require grad and to `parameters` (the trainable tensors `function` uses; others get
// none). `function` must depend on nothing else that trains, and must stay callable until
// backward. Without grad mode, or with nothing to differentiate, it simply runs. With `offload`,
// the inputs wait in its host memory until backward instead of on the device.
// Whether this thread is running a checkpointed function again for its backward: what a forward
// pass records once (trainer/model/router_loss.h) it skips then.
bool recomputing();

torch::Tensor checkpoint(const CheckpointedFunction& function, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& parameters,
                         const std::shared_ptr<ActivationOffload>& offload = nullptr);

}  // namespace qtrain::trainer
