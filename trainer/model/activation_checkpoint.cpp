#include "trainer/model/activation_checkpoint.h"

#include <torch/csrc/autograd/function.h>

#include "kernels/error.h"
#include "qat/linear.h"
#include "trainer/base/random_state.h"

namespace qtrain::trainer {

namespace {

// Marks the recomputation for as long as it lives (nested checkpoints restore the outer mark).
class Recomputing : public qat::ThreadScopedSetting<bool, Recomputing> {
 public:
  Recomputing() : ThreadScopedSetting(true) {}
  static bool now() { return current(); }
};

using torch::autograd::Edge;
using torch::autograd::variable_list;

// The values a checkpointed piece keeps beside its inputs (kept_in_recomputation): stored in its
// first run, taken back in order in its recomputation.
struct KeptValues {
  std::shared_ptr<ActivationOffload> offload;
  std::vector<int64_t> tickets;
  size_t next = 0;
  bool replaying = false;
};

// Points kept_in_recomputation at a piece's values (or at none) for as long as it lives; nested
// checkpoints (MLP chunks) restore the outer piece's.
class KeepingValues : public qat::ThreadScopedSetting<KeptValues*, KeepingValues> {
 public:
  using ThreadScopedSetting::ThreadScopedSetting;
  static KeptValues* now() { return current(); }
};

// Stored values in the place of a graph-only tensor: the gradient they get is that tensor's.
class KeptValueBackward : public torch::autograd::Node {
 public:
  std::string name() const override { return "qtrain::KeptValueBackward"; }
  variable_list apply(variable_list&& grads) override { return {grads[0]}; }
};

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
                     std::shared_ptr<ActivationOffload> offload, std::vector<int64_t> kept_values)
      : function_(std::move(function)),
        inputs_(std::move(inputs)),
        parameters_(std::move(parameters)),
        random_state_(std::move(random_state)),
        offload_(std::move(offload)),
        kept_values_(std::move(kept_values)) {}

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
      KeptValues kept{offload_, kept_values_, 0, /*replaying=*/true};
      const KeepingValues keeping(kept_values_.empty() ? nullptr : &kept);
      output = function_(inputs);
      now.restore();
      if (kept.next != kept_values_.size()) {
        throw Error(ErrorCode::kInternal, "a checkpointed piece's recomputation took " + std::to_string(kept.next) + " of the " +
                                              std::to_string(kept_values_.size()) + " values its forward kept");
      }
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
    kept_values_.clear();
    return result;
  }

 private:
  CheckpointedFunction function_;
  std::vector<KeptInput> inputs_;
  std::vector<torch::Tensor> parameters_;
  RandomState random_state_;
  std::shared_ptr<ActivationOffload> offload_;
  std::vector<int64_t> kept_values_;  // the offload's tickets of kept_in_recomputation's values
};

}  // namespace

bool recomputing() { return Recomputing::now(); }

torch::Tensor kept_in_recomputation(const ValueFunction& compute, const ValueFunction& graph_only) {
  auto* kept = KeepingValues::now();
  if (kept == nullptr) return compute();
  if (!kept->replaying) {
    auto value = compute();
    kept->tickets.push_back(kept->offload->store(value));
    return value;
  }
  if (kept->next >= kept->tickets.size()) {
    throw Error(ErrorCode::kInternal, "a checkpointed piece's recomputation asked for more values than its forward kept (" +
                                          std::to_string(kept->tickets.size()) + ")");
  }
  const auto graph = graph_only();
  auto values = kept->offload->take(kept->tickets[kept->next++]);
  if (!graph.requires_grad()) return values;
  auto node = std::shared_ptr<KeptValueBackward>(new KeptValueBackward(), torch::autograd::deleteNode);
  node->set_next_edges({torch::autograd::impl::gradient_edge(graph)});
  torch::autograd::create_gradient_edge(values, node);
  return values;
}

torch::Tensor checkpoint(const CheckpointedFunction& function, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& parameters,
                         const std::shared_ptr<ActivationOffload>& offload, bool keep_values) {
  std::vector<torch::Tensor> trainable;
  for (const auto& parameter : parameters) {
    if (parameter.requires_grad()) trainable.push_back(parameter);
  }
  const bool any_input_needs_grad =
      std::any_of(inputs.begin(), inputs.end(), [](const torch::Tensor& input) { return input.requires_grad(); });
  if (!torch::GradMode::is_enabled() || (!any_input_needs_grad && trainable.empty())) {
    const KeepingValues none(nullptr);  // nothing recomputes: an outer piece's values are not this one's
    return function(inputs);
  }

  const auto device = inputs.empty() ? torch::Device(torch::kCPU) : inputs.front().device();
  const auto random_state = RandomState::capture(device);
  torch::Tensor output;
  KeptValues kept{offload, {}, 0, /*replaying=*/false};
  {
    torch::NoGradGuard no_grad;
    const KeepingValues keeping(offload && keep_values ? &kept : nullptr);
    output = function(inputs);
  }
  std::vector<KeptInput> kept_inputs;
  for (const auto& input : inputs) {
    // Offloaded inputs leave the device now; the forward's own reference goes with its next layer.
    // (After the values kept inside: backward takes the input first, which brings back the last
    // value kept before it.)
    if (offload && input.defined()) {
      kept_inputs.push_back({torch::Tensor(), input.requires_grad(), offload->store(input)});
    } else {
      kept_inputs.push_back({input, input.requires_grad(), -1});
    }
  }
  auto node = std::shared_ptr<CheckpointBackward>(
      new CheckpointBackward(function, std::move(kept_inputs), trainable, random_state, offload, std::move(kept.tickets)),
      torch::autograd::deleteNode);
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
