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

// With `offload` and `keep_values`, the values the function marks with kept_in_recomputation wait
// in the offload's host memory beside its inputs.
torch::Tensor checkpoint(const CheckpointedFunction& function, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& parameters,
                         const std::shared_ptr<ActivationOffload>& offload = nullptr, bool keep_values = false);

using ValueFunction = std::function<torch::Tensor()>;

// A value inside a checkpointed function that its recomputation would make again only for a
// backward that reads it (a residual branch's output, which the next norm or the stream's next
// sublayer reads: train.offload_branch_outputs). In the first run of a checkpoint that keeps
// values, `compute()`'s result leaves for the host (the offload's lane) and is returned; in the
// recomputation `graph_only()` runs instead (the branch with its last product left out:
// qat::LinearLayer::forward_for_graph) and its node of autograd's graph gets the stored values,
// the same bits. Anywhere else (no checkpoint, or one that keeps none) it returns compute().
// Each run of the function must mark the same values in the same order.
torch::Tensor kept_in_recomputation(const ValueFunction& compute, const ValueFunction& graph_only);

}  // namespace qtrain::trainer
