#include "trainer/model/activation_checkpoint.h"

#include <torch/csrc/autograd/function.h>

#include "kernels/error.h"
#include "trainer/base/random_state.h"

namespace qtrain::trainer {

namespace {

thread_local bool recomputing_now = false;

// Marks the recomputation for as long as it lives (nested checkpoints restore the outer mark).
class Recomputing {
 public:
  Recomputing() : previous_(recomputing_now) { recomputing_now = true; }
  ~Recomputing() { recomputing_now = previous_; }
  Recomputing(const Recomputing&) = delete;
  Recomputing& operator=(const Recomputing&) = delete;

 private:
  bool previous_;
};

using torch::autograd::Edge;
using torch::autograd::variable_list;

// What a checkpointed piece keeps of one input: the tensor itself, or its ticket in the offload.
struct KeptInput {
  torch::Tensor tensor;
  bool requires_grad = false;
  int64_t ticket = -1;
};

// The backward of one checkpointed piece: rerun it with grad enabled and differentiate that.
class CheckpointBackward : public torch::autograd::Node {
 public:
  CheckpointBackward(CheckpointedFunction function, std::vector<KeptInput> inputs,
                     std::vector<torch::Tensor> parameters, RandomState random_state,
                     std::shared_ptr<ActivationOffload> offload)
      : function_(std::move(function)),
        inputs_(std::move(inputs)),
        parameters_(std::move(parameters)),
        random_state_(std::move(random_state)),
        offload_(std::move(offload)) {}

  std::string name() const override { return "qtrain::CheckpointBackward"; }

  variable_list apply(variable_list&& output_grads) override {
    if (!function_) throw Error(ErrorCode::kInternal, "a checkpointed piece of the model was differentiated twice (retain_graph is not supported)");
    std::vector<torch::Tensor> inputs;
    std::vector<torch::Tensor> differentiate;  // what requires grad, inputs first
    for (const auto& kept : inputs_) {
      const auto input = kept.ticket >= 0 ? offload_->take(kept.ticket) : kept.tensor;
      inputs.push_back(input.detach().requires_grad_(kept.requires_grad));
      if (kept.requires_grad) differentiate.push_back(inputs.back());
    }
    for (const auto& parameter : parameters_) differentiate.push_back(parameter);
    torch::Tensor output;
    {
      const auto now = RandomState::capture(random_state_.device_id);
      random_state_.restore();
      torch::AutoGradMode enable_grad(true);
      const Recomputing recomputing;
      output = function_(inputs);
      now.restore();
    }
    const auto grads = torch::autograd::grad({output}, differentiate, {output_grads[0]}, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    // One gradient per next edge, in the order the edges were made: inputs, then parameters.
    variable_list result;
    size_t next = 0;
    for (const auto& kept : inputs_) result.push_back(kept.requires_grad ? grads[next++] : torch::Tensor());
    for (size_t index = 0; index < parameters_.size(); ++index) result.push_back(grads[next++]);
    function_ = nullptr;  // the closure may hold large tensors; the graph is used once
    inputs_.clear();
    offload_.reset();
    return result;
  }

 private:
  CheckpointedFunction function_;
  std::vector<KeptInput> inputs_;
  std::vector<torch::Tensor> parameters_;
  RandomState random_state_;
  std::shared_ptr<ActivationOffload> offload_;
};

}  // namespace

bool recomputing() { return recomputing_now; }

torch::Tensor checkpoint(const CheckpointedFunction& function, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& parameters,
                         const std::shared_ptr<ActivationOffload>& offload) {
  std::vector<torch::Tensor> trainable;
  for (const auto& parameter : parameters) {
    if (parameter.requires_grad()) trainable.push_back(parameter);
  }
  const bool any_input_needs_grad =
      std::any_of(inputs.begin(), inputs.end(), [](const torch::Tensor& input) { return input.requires_grad(); });
  if (!torch::GradMode::is_enabled() || (!any_input_needs_grad && trainable.empty())) return function(inputs);

  const auto device = inputs.empty() ? torch::Device(torch::kCPU) : inputs.front().device();
  const auto random_state = RandomState::capture(device);
  torch::Tensor output;
  {
    torch::NoGradGuard no_grad;
    output = function(inputs);
  }
  std::vector<KeptInput> kept;
  for (const auto& input : inputs) {
    // Offloaded inputs leave the device now; the forward's own reference goes with its next layer.
    if (offload && input.defined()) {
      kept.push_back({torch::Tensor(), input.requires_grad(), offload->store(input)});
    } else {
      kept.push_back({input, input.requires_grad(), -1});
    }
  }
  auto node = std::shared_ptr<CheckpointBackward>(
      new CheckpointBackward(function, std::move(kept), trainable, random_state, offload), torch::autograd::deleteNode);
  torch::autograd::edge_list edges;
  for (const auto& input : inputs) {
    edges.push_back(input.requires_grad() ? torch::autograd::impl::gradient_edge(input) : Edge());
  }
  for (const auto& parameter : trainable) edges.push_back(torch::autograd::impl::gradient_edge(parameter));
  node->set_next_edges(std::move(edges));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace qtrain::trainer
