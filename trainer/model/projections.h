#pragma once
// A decoder block's projections: their shapes as plain data, which the blocks build from and the
// memory estimate and LoRA targeting read before any model exists (so the two cannot drift); how
// a block makes them (LinearFactory) and how it swaps one for a LoRA or QAT layer.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qat/linear.h"

namespace qtrain::trainer {

// Builds the projection a model position needs (`name` like "model.layers.0.self_attn.q_proj").
// The default makes dense layers; QLoRA / QAT pass factories that make their own kinds.
using LinearFactory = std::function<std::shared_ptr<qat::LinearLayer>(const std::string& name,
                                                                      const qat::DenseLinearOptions&)>;
LinearFactory dense_linear_factory();

// What a projection reads: its block's input (the normed residual stream, one tensor for every
// projection that reads it, which adapters make again from the norm), or an activation made
// inside the block (attention's output, the MLP's gated product).
enum class ProjectionInput { kBlockInput, kBlockActivation };

struct ProjectionShape {
  std::string name;  // relative to its block, as transformers and peft name it: "q_proj", "gate_up_proj"
  int64_t in = 0;    // the weight is [out, in]
  int64_t out = 0;
  bool bias = false;
  ProjectionInput input = ProjectionInput::kBlockInput;
  // > 0: a bank of this many experts' weights (qat/expert_linear.h), `out` = experts × each one's rows.
  int64_t experts = 0;
  // The frozen base keeps it in the model dtype whatever it quantizes (a router: bitsandbytes'
  // QLoRA of transformers 5 leaves it too, as it is no nn.Linear there).
  bool stays_dense = false;
};

qat::DenseLinearOptions projection_options(const ProjectionShape& shape, torch::ScalarType dtype);

// The member a block's forward() calls for its projection `child_name`; null when it has none.
using ProjectionSlot = std::function<std::shared_ptr<qat::LinearLayer>*(const std::string& child_name)>;

// Makes `shapes` in their order (make_linear gets prefix + "." + name), registers each under its
// name in `owner` and points slot(name) at it.
void register_projections(torch::nn::Module& owner, const std::vector<ProjectionShape>& shapes,
                          const std::string& prefix, const LinearFactory& make_linear, torch::ScalarType dtype,
                          const ProjectionSlot& slot);

// Points slot(child_name) (the member forward() calls) and the registered child `child_name` at
// `layer`: qat::LinearLayerOwner::replace_linear for a block whose projections `slot` names.
void replace_projection(torch::nn::Module& owner, const ProjectionSlot& slot, const std::string& child_name,
                        std::shared_ptr<qat::LinearLayer> layer);

}  // namespace qtrain::trainer
