#pragma once
// A mixture-of-experts checkpoint's expert tensors, in either layout a Hugging Face directory
// holds them (trainer/model/model_families.h's ExpertTensorNames):
//   per expert (the published checkpoints, transformers 4): model.layers.N.mlp.experts.E.gate_proj.weight
//     [intermediate, hidden], up_proj, down_proj (Mixtral: block_sparse_moe.experts.E.w1 / w3 / w2, its
//     router block_sparse_moe.gate);
//   fused (transformers 5's save_pretrained in memory form): model.layers.N.mlp.experts.gate_up_proj
//     [experts, 2 · intermediate, hidden] (gate's rows first), mlp.experts.down_proj [experts, hidden, intermediate];
// and the model's expert banks (qat/expert_linear.h), which hold them as [experts × rows, columns].
#include <torch/torch.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "trainer/formats/hf_config.h"

namespace qtrain::trainer {

class SafetensorsCheckpoint;

// Fills every expert bank and router of `model` (built from `config`) from `weights`, in whichever
// layout they are stored; adds the model tensors it filled and the checkpoint tensors it read to
// `loaded` (load_state's loaded_elsewhere). A missing or misshapen tensor is an Error naming it and
// `source`. Nothing for a dense model.
void load_expert_tensors(torch::nn::Module& model, const HfModelConfig& config, const SafetensorsCheckpoint& weights,
                         const std::string& source, std::set<std::string>& loaded);

// The tensors to write for the model tensor `name` (`tensor`, as merged_weights gives it): an
// expert bank becomes one tensor per expert (and gate_up_proj two: gate, up) under the family's
// published names, the router its name there; anything else is itself.
std::vector<std::pair<std::string, torch::Tensor>> published_expert_tensors(const HfModelConfig& config,
                                                                           const std::string& name,
                                                                           const torch::Tensor& tensor);

}  // namespace qtrain::trainer
