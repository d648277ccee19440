// train.optimizer_states_on_host (trainer/optimizer_states_on_host.h): the updates are those of a
// state kept on the device, bit for bit; between steps every state tensor is a view of one host
// block, and on the GPU the device holds none of it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/sgd.h"
#include "small_llama.h"
#include "trainer/base/memory_stats.h"
#include "trainer/loss_scaler.h"
#include "trainer/model/device_copies.h"
#include "trainer/deferred_update.h"
#include "trainer/optimizer_states_on_host.h"
#include "trainer/training_step.h"

namespace qtrain::trainer {
namespace {

// A few parameters of the shapes LoRA trains (and a bf16 one, which keeps an fp32 master).
std::vector<torch::Tensor> parameters_on(const torch::Device& device) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> parameters;
  for (const auto& sizes : std::vector<std::vector<int64_t>>{{16, 64}, {64, 16}, {8, 300}, {300}}) {
    parameters.push_back(torch::randn(sizes).to(device).requires_grad_(true));
  }
  parameters.push_back(torch::randn({24, 40}).to(device, torch::kBFloat16).requires_grad_(true));
  return parameters;
}

std::unique_ptr<optim::Optimizer> optimizer_named(const std::string& name, std::vector<torch::Tensor> parameters) {
  return optim::make_optimizer(name, std::move(parameters), 1e-2, 0.1, {0.9, 0.99}, 1e-8, 0.9);
}

// Five steps of `name` from fresh gradients: the parameters, then the state, after each. With
// `on_host`, the state goes to the host after each step and comes back before the next.
std::vector<torch::Tensor> steps_of(const std::string& name, const torch::Device& device, bool on_host) {
  auto parameters = parameters_on(device);
  auto optimizer = optimizer_named(name, parameters);
  std::unique_ptr<OptimizerStatesOnHost> keeper;
  if (on_host) keeper = std::make_unique<OptimizerStatesOnHost>(*optimizer, device);
  std::vector<torch::Tensor> seen;
  torch::manual_seed(12);
  for (int step = 0; step < 5; ++step) {
    for (auto& parameter : parameters) parameter.mutable_grad() = torch::randn_like(parameter);
    if (keeper) {
      if (step == 3) {
        keeper->prefetch();  // a skipped step: fetched during backward, back without an update
        keeper->depart();
      }
      if (step % 2 == 1) keeper->prefetch();  // the other steps fetch in arrive()
      keeper->arrive();
      if (step > 0) {
        for (const auto& [field, tensor] : optimizer->state()) EXPECT_EQ(tensor.device(), device) << field;
      }
    }
    optimizer->step();
    if (keeper) {
      keeper->depart();
      keeper->settle();
      // One host block holds every state tensor between steps; on a GPU, none is on the device.
      const auto state = optimizer->state();
      EXPECT_FALSE(state.empty());
      for (const auto& [field, tensor] : state) {
        EXPECT_TRUE(tensor.is_cpu()) << field;
        EXPECT_TRUE(tensor.storage().is_alias_of(state.front().second.storage())) << field;
        if (device.is_cuda()) EXPECT_TRUE(tensor.is_pinned()) << field;
      }
    }
    for (const auto& parameter : parameters) seen.push_back(parameter.detach().cpu().clone());
    for (const auto& [field, tensor] : optimizer->state()) seen.push_back(tensor.cpu().clone());
  }
  if (keeper) {
    keeper.reset();  // leaves the state on the device, as it found it
    for (const auto& [field, tensor] : optimizer->state()) EXPECT_EQ(tensor.device(), device) << field;
  }
  return seen;
}

void expect_the_same_steps(const torch::Device& device) {
  for (const std::string name : {"adamw", "adamw8bit", "sgd"}) {
    const auto kept = steps_of(name, device, false);
    const auto moved = steps_of(name, device, true);
    ASSERT_EQ(kept.size(), moved.size()) << name;
    for (size_t index = 0; index < kept.size(); ++index) {
      EXPECT_TRUE(torch::equal(kept[index], moved[index])) << name << " on " << device << ": tensor " << index;
    }
  }
}

TEST(OptimizerStatesOnHost, StepsEqualAStateKeptInPlaceBitwise) { expect_the_same_steps(torch::kCPU); }

// The state's views of its block (trainer/model/device_copies.h): they alias the bytes, keep them
// alive, and refuse a range or an alignment the block does not have.
TEST(TypedView, AliasesItsBufferAndRefusesWhatDoesNotFit) {
  auto bytes = torch::zeros({64}, torch::kUInt8);
  auto floats = typed_view(bytes, 16, {2, 3}, torch::kFloat32);
  EXPECT_EQ(floats.sizes(), torch::IntArrayRef({2, 3}));
  EXPECT_EQ(floats.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(floats.is_contiguous());
  floats.fill_(1.0f);
  const auto expected = torch::ones({6}, torch::kFloat32);
  EXPECT_TRUE(torch::equal(bytes.narrow(0, 16, 24).view(torch::kFloat32), expected));
  EXPECT_EQ(bytes.narrow(0, 0, 16).sum().item<int64_t>(), 0);
  EXPECT_EQ(bytes.narrow(0, 40, 24).sum().item<int64_t>(), 0);
  // A view of a view's range starts where that range does.
  auto tail = typed_view(bytes.narrow(0, 32, 32), 8, {2}, torch::kFloat32);
  tail.fill_(2.0f);
  EXPECT_TRUE(torch::equal(bytes.narrow(0, 40, 8).view(torch::kFloat32), torch::full({2}, 2.0f)));
  bytes = torch::Tensor();  // the views keep the storage
  EXPECT_EQ(floats.sum().item<float>(), 6.0f);
  EXPECT_EQ(tail.sum().item<float>(), 4.0f);
  auto buffer = torch::zeros({64}, torch::kUInt8);
  EXPECT_THROW(typed_view(buffer, 48, {5}, torch::kFloat32), Error);   // past the end
  EXPECT_THROW(typed_view(buffer, 2, {1}, torch::kFloat32), Error);    // not aligned to the dtype
  EXPECT_THROW(typed_view(buffer, -4, {1}, torch::kFloat32), Error);
  EXPECT_THROW(typed_view(buffer.view(torch::kFloat32), 0, {1}, torch::kFloat32), Error);  // not bytes
}

TEST(OptimizerStatesOnHost, CudaStepsEqualAStateKeptOnTheDeviceBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_the_same_steps(torch::Device(torch::kCUDA, 0));
}

TEST(OptimizerStatesOnHost, CudaTheDeviceHoldsNoStateBetweenSteps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  auto parameters = parameters_on(cuda);
  auto optimizer = optimizer_named("adamw", parameters);
  OptimizerStatesOnHost keeper(*optimizer, cuda);
  for (auto& parameter : parameters) parameter.mutable_grad() = torch::randn_like(parameter);
  optimizer->step();  // the first step makes the state on the device
  torch::cuda::synchronize();
  const double with_state = memory_usage(cuda).current_bytes;
  keeper.depart();
  keeper.settle();
  torch::cuda::synchronize();
  const double without = memory_usage(cuda).current_bytes;
  // Two fp32 moments a value, an fp32 master for the bf16 parameter, a step counter each.
  double state_bytes = 0;
  for (const auto& [field, tensor] : optimizer->state()) state_bytes += tensor.numel() * tensor.element_size();
  EXPECT_GE(with_state - without, state_bytes);
  EXPECT_GE(static_cast<double>(keeper.host_bytes()), state_bytes);
  keeper.arrive();
  for (const auto& [field, tensor] : optimizer->state()) EXPECT_TRUE(tensor.is_cuda()) << field;
}

// A checkpoint loaded while the state waits on the host is what the next step uses.
TEST(OptimizerStatesOnHost, AStateLoadedWhileOnTheHostIsTheOneUsed) {
  auto parameters = parameters_on(torch::kCPU);
  auto optimizer = optimizer_named("adamw", parameters);
  OptimizerStatesOnHost keeper(*optimizer, torch::kCPU);
  for (auto& parameter : parameters) parameter.mutable_grad() = torch::randn_like(parameter);
  optimizer->step();
  keeper.depart();
  auto loaded = optimizer->state();
  for (auto& [field, tensor] : loaded) tensor = torch::full_like(tensor, 3.0);
  optimizer->load_state(loaded);
  keeper.arrive();
  for (const auto& [field, tensor] : optimizer->state()) {
    EXPECT_TRUE(torch::equal(tensor, torch::full_like(tensor, 3.0))) << field;
  }
}


// In a training step each decoder layer's update waits for the next forward, which applies it
// just before the layer runs, its state fetched from the host block of the layer's parameters:
// the losses, gradient norms and weights of every step equal those of an update made at once,
// bit for bit, with gradient accumulation and a checkpoint's read between steps.
struct StepsSeen {
  std::vector<double> losses, norms;
  std::vector<torch::Tensor> weights;
};

StepsSeen training_steps(bool states_on_host, const std::string& optimizer_name) {
  torch::manual_seed(5);
  LlamaForCausalLM model(testing::small_llama_options(32, 4), torch::kFloat32);
  auto trainable = model->parameters();
  auto optimizer = optimizer_named(optimizer_name, trainable);
  LossScaler scaler(false);
  TrainingStepOptions options;
  options.optimizer_states_on_host = states_on_host;
  StepsSeen seen;
  {
    TrainingStep step(*model, trainable, *optimizer, scaler, options);
    torch::manual_seed(6);
    for (int index = 0; index < 5; ++index) {
      std::vector<data::Batch> window;
      for (int micro = 0; micro < 1 + index % 2; ++micro) window.push_back(testing::small_llama_batch(2, 12));
      optimizer->set_learning_rate(1e-2 * (1 + index));  // a schedule: each update keeps its step's rate
      const auto result = step.run(window, index);
      seen.losses.push_back(result.loss);
      seen.norms.push_back(result.grad_norm);
      if (index == 2) step.settle_optimizer_state();  // a checkpoint reads the weights here
    }
    step.settle_optimizer_state();
    for (const auto& parameter : trainable) EXPECT_FALSE(parameter.grad().defined());
  }
  for (const auto& parameter : trainable) seen.weights.push_back(parameter.detach().clone());
  return seen;
}

TEST(OptimizerStatesOnHost, EachLayersUpdateInTheNextForwardEqualsTheUpdateAtOnceBitwise) {
  for (const std::string name : {"adamw", "adamw8bit", "sgd"}) {
    const auto at_once = training_steps(false, name);
    const auto deferred = training_steps(true, name);
    EXPECT_EQ(at_once.losses, deferred.losses) << name;
    EXPECT_EQ(at_once.norms, deferred.norms) << name;
    ASSERT_EQ(at_once.weights.size(), deferred.weights.size());
    for (size_t index = 0; index < at_once.weights.size(); ++index) {
      EXPECT_TRUE(torch::equal(at_once.weights[index], deferred.weights[index])) << name << ": parameter " << index;
    }
  }
}

// Between steps each layer's update waits with its state in a host block of its own; the forward
// applies layer i's before layer i runs, and the parameters outside the layers are updated at once.
TEST(OptimizerStatesOnHost, TheForwardAppliesEachLayersUpdateBeforeTheLayerRuns) {
  torch::manual_seed(5);
  LlamaForCausalLM model(testing::small_llama_options(32, 4), torch::kFloat32);
  auto trainable = model->parameters();
  auto optimizer = optimizer_named("adamw", trainable);
  DeferredUpdate deferred(*model, *optimizer, torch::kCPU);
  const auto layers = model->model->layers->size();
  ASSERT_GE(layers, 2u);
  const auto first_layer = model->model->layers[0]->parameters().front();
  const auto last_layer = model->model->layers[layers - 1]->parameters().front();
  const auto final_norm = model->model->norm->weight;
  for (auto& parameter : trainable) parameter.mutable_grad() = torch::ones_like(parameter);
  const auto before = std::vector<torch::Tensor>{first_layer.clone(), last_layer.clone(), final_norm.clone()};
  deferred.defer();
  EXPECT_EQ(deferred.pending(), layers);
  for (const auto& parameter : trainable) EXPECT_FALSE(parameter.grad().defined());
  EXPECT_FALSE(torch::equal(final_norm, before[2])) << "outside the layers: updated at once";
  EXPECT_TRUE(torch::equal(first_layer, before[0]));
  // A forward applies every layer's update (before each layer runs: the losses of the test above).
  {
    torch::NoGradGuard no_grad;
    LlamaInputs inputs;
    inputs.input_ids = torch::randint(97, {1, 6}, torch::kInt64);
    model->forward(inputs);
  }
  EXPECT_EQ(deferred.pending(), 0u);
  EXPECT_FALSE(torch::equal(first_layer, before[0]));
  EXPECT_FALSE(torch::equal(last_layer, before[1]));
  // Each layer's state waits in a host block of its own.
  const auto index_of = [&](const torch::Tensor& parameter) {
    for (size_t index = 0; index < trainable.size(); ++index) {
      if (trainable[index].is_same(parameter)) return std::to_string(index);
    }
    return std::string("none");
  };
  torch::Tensor first_state, last_state, norm_state;
  for (const auto& [name, tensor] : optimizer->state()) {
    if (name == index_of(first_layer) + ".exp_avg") first_state = tensor;
    if (name == index_of(last_layer) + ".exp_avg") last_state = tensor;
    if (name == index_of(final_norm) + ".exp_avg") norm_state = tensor;
  }
  ASSERT_TRUE(first_state.defined() && last_state.defined() && norm_state.defined());
  EXPECT_FALSE(first_state.storage().is_alias_of(last_state.storage()));
  EXPECT_FALSE(first_state.storage().is_alias_of(norm_state.storage()));
}

}  // namespace
}  // namespace qtrain::trainer
