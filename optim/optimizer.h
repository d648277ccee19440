#pragma once
// The interface the training loop steps: an optimizer owns the trainable parameters' update
// rule and its state. State lives per parameter under field names ("exp_avg", "master", ...)
// so a checkpoint can save it as "<parameter index>.<field>" and load it back.
//
// Low-precision parameters (bf16, fp16) are updated through an fp32 master copy kept in the
// state under "master": the update runs in fp32 and the parameter receives the master rounded
// to its own dtype after every step, so small updates accumulate instead of rounding away.
#include <torch/torch.h>

#include <map>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace qtrain::optim {

// Named state tensors, e.g. {"0.step", ...}, {"0.exp_avg", ...}; the order is stable.
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update from each parameter's .grad(); parameters without a grad are skipped and their
  // state is left as it was.
  virtual void step() = 0;
  // Sets every gradient to undefined (PyTorch's set_to_none default).
  void zero_grad();

  void set_learning_rate(double lr);
  double learning_rate() const { return learning_rate_; }
  const std::vector<torch::Tensor>& parameters() const { return parameters_; }

  // Every state tensor by a stable name "<parameter index>.<field>"; parameters that never took
  // a step have no entries. The tensors are the live state (not copies).
  virtual NamedTensors state() const;
  // Loads what state() returned (from this or an identical optimizer): copies each tensor onto
  // its parameter's device and dtype, checks names and shapes, and writes master copies back to
  // their parameters. Throws qtrain::Error naming the offending entry.
  virtual void load_state(const NamedTensors& state);
  // Every state tensor's slot, named as state() names it: a holder that keeps the state elsewhere
  // between steps (trainer/optimizer_states_on_host.h) points a slot at the same values on another
  // device, and back at the parameter's device before step().
  std::vector<std::pair<std::string, torch::Tensor*>> state_slots();
  // The slots of these parameters only (indices into parameters(), in that order).
  std::vector<std::pair<std::string, torch::Tensor*>> state_slots(const std::vector<size_t>& indices);

 protected:
  Optimizer(std::vector<torch::Tensor> parameters, double learning_rate, const std::string& name);

  // The fields a parameter's state holds once it has taken a step, in the order state() lists them.
  virtual std::vector<std::string> state_fields(size_t index) const = 0;

  // What load_state expects of one state tensor.
  struct StateTensorSpec {
    std::vector<int64_t> sizes;  // {} for a scalar ("step")
    torch::ScalarType dtype;
  };
  // By default "step" is an fp32 scalar and every other field has the parameter's shape, in fp32
  // for low-precision parameters (their update runs on the master) and the parameter's dtype else.
  virtual StateTensorSpec state_tensor_spec(size_t index, const std::string& field) const;

  // True for bf16/fp16 parameters, which are updated through an fp32 "master" copy.
  static bool needs_master(const torch::Tensor& parameter);
  // The tensor an update writes to: the fp32 master for low-precision parameters (created on
  // first use), the parameter itself otherwise.
  torch::Tensor& update_target(size_t index);
  // Copies the master of parameter `index` (if it has one) back into the parameter, rounding.
  void write_back_master(size_t index);
  // The gradient of parameter `index` in the dtype of its update target (fp32 for masters).
  torch::Tensor gradient_for_update(size_t index) const;

  std::vector<torch::Tensor> parameters_;
  // Per parameter: field name -> tensor; empty until the parameter's first step.
  std::vector<std::map<std::string, torch::Tensor>> parameter_state_;
  double learning_rate_;
  std::string name_;  // "adamw", "sgd": used in error messages
};

// The optimizer a recipe's `optim` section names: "adamw", "adamw8bit" or "sgd". betas =
// [beta1, beta2] and eps are AdamW's (their bounds: check_adamw_options; the recipe's key table
// checks optim.betas' length and bounds for the user); SGD ignores them and takes `momentum`
// (0 = plain SGD).
std::unique_ptr<Optimizer> make_optimizer(const std::string& name, std::vector<torch::Tensor> parameters, double lr,
                                          double weight_decay, const std::array<double, 2>& betas, double eps,
                                          double momentum = 0.0);

}  // namespace qtrain::optim
