#pragma once
// train.optimizer_states_on_host: a step's update waits for the next forward, which applies each
// decoder layer's share just before the layer runs. The layer's optimizer state comes from the
// host while the layer before it runs, and goes back while the layer itself runs, each way on a
// copy lane of its own (trainer/optimizer_states_on_host.h), so the device holds a layer's share
// or two of the state at a time, never the whole: a mixture of experts' adapters carry gigabytes
// of it, more than half of the forward's other memory.
//
// The update is the one the step would have made: the gradients (checked, clipped) and the
// learning rate of the step wait with it, and each layer's share runs the optimizer's own step
// over that layer's parameters, so the weights are equal bit for bit with an update made at
// once. The parameters outside the decoder layers (a trained embedding table or lm_head, the
// final norm) are updated at once. Whatever reads the weights or the state other than the
// model's forward (a checkpoint, an export, the end of a run) calls apply_all() first.
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "optim/optimizer.h"
#include "trainer/model/llama.h"
#include "trainer/optimizer_states_on_host.h"

namespace qtrain::trainer {

class DeferredUpdate {
 public:
  // Holds references (the model and the optimizer outlive this) and sets the model's hook before
  // each decoder layer. `device`: the trained parameters'.
  DeferredUpdate(LlamaForCausalLMImpl& model, optim::Optimizer& optimizer, const torch::Device& device);
  // Applies what waits and takes the hook away; the state is left on the device.
  ~DeferredUpdate();
  DeferredUpdate(const DeferredUpdate&) = delete;
  DeferredUpdate& operator=(const DeferredUpdate&) = delete;

  // In place of optimizer.step(), after the gradients are checked and clipped: the parameters
  // outside the layers are updated now, each layer's wait for its next forward with their
  // gradients and the learning rate now. The gradients leave the parameters.
  void defer();
  // Every update that waits, now.
  void apply_all();
  // The copies of the state to the host are done (before the host reads it).
  void settle() const;
  // How many layers' updates wait.
  size_t pending() const;

 private:
  struct Group {
    std::vector<size_t> parameters;  // indices into the optimizer's parameters
    std::unique_ptr<OptimizerStatesOnHost> state;
    bool pending = false;
  };
  // The update of groups_[group] (its state fetched if it is not on its way), the next group's
  // state sent for first.
  void apply(size_t group);
  void step(Group& group);

  LlamaForCausalLMImpl& model_;
  optim::Optimizer& optimizer_;
  std::vector<Group> groups_;  // [0]: outside the layers; [1 + i]: decoder layer i
  std::vector<torch::Tensor> gradients_;  // per optimizer parameter, while its update waits
  double learning_rate_ = 0;
};

}  // namespace qtrain::trainer
