// 8-bit AdamW's contract apart from bitsandbytes' numbers (those are in
// tests/trainer/bnb_8bit_reference_test.cpp): which parameters get 8-bit state, what the state
// holds and costs, exact resume from a saved state, the NaN guard, and the 32-bit path.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "kernels/blockwise_8bit.h"
#include "kernels/cuda_build.h"
#include "kernels/error.h"
#include "optim/adamw8bit.h"

namespace qtrain::optim {
namespace {

AdamW8bitOptions test_8bit_options() {
  AdamW8bitOptions options;
  options.adamw.lr = 1e-3;
  options.adamw.beta1 = 0.9;
  options.adamw.beta2 = 0.99;
  options.adamw.eps = 1e-8;
  options.adamw.weight_decay = 0.01;
  return options;
}

// [64, 96] (6144 elements: 8-bit, 24 blocks) and [63] (32-bit).
std::vector<torch::Tensor> parameters(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({64, 96}).requires_grad_(), torch::randn({63}).requires_grad_()};
}

void set_grads(std::vector<torch::Tensor>& params, uint64_t seed) {
  torch::manual_seed(seed);
  for (auto& parameter : params) parameter.mutable_grad() = torch::randn(parameter.sizes()) * 0.01;
}

std::map<std::string, torch::Tensor> state_map(const Optimizer& optimizer) {
  std::map<std::string, torch::Tensor> named;
  for (const auto& [name, tensor] : optimizer.state()) named[name] = tensor;
  return named;
}

TEST(AdamW8bit, LargeParametersKeepBlockwise8bitStateSmallOnesFp32) {
  auto params = parameters(1);
  AdamW8bit optimizer(params, test_8bit_options());
  set_grads(params, 2);
  optimizer.step();
  const auto state = state_map(optimizer);
  EXPECT_EQ(state.at("0.state1").scalar_type(), torch::kUInt8);
  EXPECT_EQ(state.at("0.state2").sizes(), params[0].sizes());
  EXPECT_EQ(state.at("0.absmax1").sizes(), (std::vector<int64_t>{24}));
  EXPECT_EQ(state.at("1.exp_avg").scalar_type(), torch::kFloat);
  EXPECT_FALSE(state.count("1.state1"));
  // The 8-bit state of parameter 0 is a quarter of AdamW's 8 bytes per element, plus absmax.
  int64_t bytes = 0;
  for (const std::string field : {"state1", "state2", "absmax1", "absmax2"}) bytes += state.at("0." + field).nbytes();
  EXPECT_EQ(bytes, 2 * params[0].numel() + 2 * 24 * 4);
  EXPECT_LT(bytes * 3.9, 8.0 * params[0].numel());
}

// The moments decode to the fp32 moments of an unquantized run within the map's resolution, and
// the first step is Adam's first step: -lr * g / (|g| + eps), then the decay.
TEST(AdamW8bit, FirstStepMovesEachWeightByLrAgainstItsGradient) {
  auto params = parameters(3);
  const auto before = params[0].detach().clone();
  AdamW8bit optimizer(params, test_8bit_options());
  set_grads(params, 4);
  const auto grad = params[0].grad().clone();
  optimizer.step();
  const double lr = 1e-3;
  const auto expected = (before - lr * grad / (grad.abs() + 1e-8)) * (1 - lr * 0.01);
  EXPECT_LE((params[0].detach() - expected).abs().max().item<double>(), 1e-6);
  const auto state = state_map(optimizer);
  const auto first = kernels::dequantize_blockwise_8bit(state.at("0.state1"), state.at("0.absmax1"),
                                                        kernels::signed_dynamic_map(), 256);
  // 8-bit dynamic codes: within about 1/50 of the block's absmax (the map is coarse near 1).
  const auto error = (first - 0.1 * grad).abs().max().item<double>();
  EXPECT_LE(error, state.at("0.absmax1").max().item<double>() / 50);
}

TEST(AdamW8bit, ResumesExactlyFromItsSavedState) {
  auto original = parameters(5);
  AdamW8bit first(original, test_8bit_options());
  for (uint64_t step = 0; step < 3; ++step) {
    set_grads(original, 10 + step);
    first.step();
  }
  // A second optimizer on copies of the parameters, loaded from the first one's state.
  std::vector<torch::Tensor> resumed;
  for (const auto& parameter : original) resumed.push_back(parameter.detach().clone().requires_grad_());
  AdamW8bit second(resumed, test_8bit_options());
  NamedTensors saved;
  for (const auto& [name, tensor] : first.state()) saved.emplace_back(name, tensor.clone());
  second.load_state(saved);
  for (uint64_t step = 3; step < 5; ++step) {
    set_grads(original, 10 + step);
    set_grads(resumed, 10 + step);
    first.step();
    second.step();
  }
  for (size_t i = 0; i < original.size(); ++i) EXPECT_TRUE(torch::equal(original[i], resumed[i])) << i;
  const auto a = state_map(first), b = state_map(second);
  for (const auto& [name, tensor] : a) EXPECT_TRUE(torch::equal(tensor, b.at(name))) << name;
}

TEST(AdamW8bit, LoadStateKeepsCodesAsTheyAreAndRejectsWrongTensors) {
  auto params = parameters(6);
  AdamW8bit optimizer(params, test_8bit_options());
  set_grads(params, 7);
  optimizer.step();
  auto saved = optimizer.state();
  const auto expect_error = [&](const std::string& field, const torch::Tensor& tensor, const std::string& text) {
    NamedTensors changed;
    for (const auto& [name, value] : saved) changed.emplace_back(name, name == field ? tensor : value);
    try {
      optimizer.load_state(changed);
      ADD_FAILURE() << "no error for " << field;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
    }
  };
  expect_error("0.state1", torch::zeros({64, 96}), "'0.state1' has dtype Float, expected Byte");
  expect_error("0.absmax2", torch::zeros({23}), "'0.absmax2' has shape [23], expected [24]");
  expect_error("0.state2", torch::zeros({96, 64}, torch::kUInt8), "'0.state2' has shape [96, 64]");
}

TEST(AdamW8bit, NonFiniteGradientsLeaveTheirWeightsAndZeroTheirMoments) {
  auto params = parameters(8);
  const auto before = params[0].detach().clone();
  AdamW8bit optimizer(params, test_8bit_options());
  set_grads(params, 9);
  params[0].mutable_grad()[0][0] = std::nan("");
  params[0].mutable_grad()[0][1] = INFINITY;
  optimizer.step();
  EXPECT_EQ(params[0][0][0].item<float>(), before[0][0].item<float>());
  EXPECT_EQ(params[0][0][1].item<float>(), before[0][1].item<float>());
  EXPECT_NE(params[0][0][2].item<float>(), before[0][2].item<float>());
  const auto state = state_map(optimizer);
  const auto second = kernels::dequantize_blockwise_8bit(state.at("0.state2"), state.at("0.absmax2"),
                                                         kernels::unsigned_dynamic_map(), 256);
  EXPECT_EQ(second[0][0].item<float>(), 0.0f);
  EXPECT_TRUE(torch::isfinite(second).all().item<bool>());
}

// The fused CUDA step (kernels/adamw8bit_step.h) gives the torch-operation reference's bits:
// parameters (an fp32 one with a partial last block, a bf16 one through its fp32 master, a small
// 32-bit one), codes and absmax values, over steps with gradients of very different sizes (tiny
// ones make codes land near zero, where the sign rule acts) and non-finite entries.
TEST(AdamW8bit, FusedCudaStepEqualsTheTorchOperationsBitForBit) {
  if (!kernels::kCudaKernelsBuilt || !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(21);
  const auto cuda = torch::Device(torch::kCUDA);
  const std::vector<torch::Tensor> initial = {torch::randn({300, 129}, cuda), torch::randn({64, 96}, cuda).to(torch::kBFloat16),
                                              torch::randn({63}, cuda)};
  auto make = [&](bool fused) {
    std::vector<torch::Tensor> params;
    for (const auto& tensor : initial) params.push_back(tensor.clone().requires_grad_());
    auto options = test_8bit_options();
    options.fused_cuda_step = fused;
    return std::make_pair(params, std::make_unique<AdamW8bit>(params, options));
  };
  auto [fused_params, fused] = make(true);
  auto [reference_params, reference] = make(false);
  const std::vector<double> grad_scales = {1e-2, 1e-7, 3.0, 1e-2, 1e3, 1e-4};
  for (size_t step = 0; step < grad_scales.size(); ++step) {
    for (size_t index = 0; index < initial.size(); ++index) {
      auto grad = torch::randn(initial[index].sizes(), cuda) * grad_scales[step];
      if (step == 3 && fused->has_8bit_state(index)) {  // the 32-bit path has no NaN guard, as bnb's
        grad.view(-1)[5] = std::nan("");
        grad.view(-1)[grad.numel() - 1] = -INFINITY;
      }
      fused_params[index].mutable_grad() = grad.to(initial[index].scalar_type());
      reference_params[index].mutable_grad() = grad.to(initial[index].scalar_type());
    }
    fused->step();
    reference->step();
    for (size_t index = 0; index < initial.size(); ++index) {
      EXPECT_TRUE(torch::equal(fused_params[index], reference_params[index]))
          << "step " << step << ", parameter " << index << ": max |difference| "
          << (fused_params[index] - reference_params[index]).abs().max().item<float>();
    }
    const auto fused_state = state_map(*fused);
    for (const auto& [name, tensor] : state_map(*reference)) {
      EXPECT_TRUE(torch::equal(fused_state.at(name), tensor)) << "step " << step << ", state " << name;
    }
  }
}

// Below min_8bit_size the update is bnb's 32-bit kernel: Adam with the bias corrections folded
// into the step size and eps scaled by sqrt(1 - beta2^t), weight decay after the step. Checked
// against the same formulas in float64.
TEST(AdamW8bit, SmallParametersFollowBitsandbytes32bitUpdate) {
  auto params = parameters(11);
  auto reference = params[1].detach().to(torch::kDouble);
  const auto options = test_8bit_options();
  AdamW8bit optimizer(params, options);
  auto m = torch::zeros_like(reference), v = torch::zeros_like(reference);
  for (int t = 1; t <= 4; ++t) {
    set_grads(params, 20 + t);
    const auto g = params[1].grad().to(torch::kDouble);
    optimizer.step();
    const double b1 = options.adamw.beta1, b2 = options.adamw.beta2, lr = options.adamw.lr;
    m = m * b1 + (1 - b1) * g;
    v = v * b2 + (1 - b2) * g * g;
    const double c2 = std::sqrt(1 - std::pow(b2, t));
    reference = reference - lr * c2 / (1 - std::pow(b1, t)) * m / (v.sqrt() + options.adamw.eps * c2);
    reference = reference * (1 - lr * options.adamw.weight_decay);
  }
  EXPECT_LE((params[1].detach().to(torch::kDouble) - reference).abs().max().item<double>(), 1e-6);
}

TEST(AdamW8bit, MakeOptimizerBuildsItAndChecksItsOptions) {
  auto params = parameters(12);
  const auto optimizer = make_optimizer("adamw8bit", params, 3e-4, 0.01, {0.9, 0.98}, 1e-7);
  const auto* adamw8bit = dynamic_cast<const AdamW8bit*>(optimizer.get());
  ASSERT_NE(adamw8bit, nullptr);
  EXPECT_EQ(adamw8bit->learning_rate(), 3e-4);
  EXPECT_EQ(adamw8bit->options().adamw.beta2, 0.98);
  EXPECT_THROW(make_optimizer("adamw8bit", params, 3e-4, 0.0, {0.9, 1.0}, 1e-8), Error);
}

}  // namespace
}  // namespace qtrain::optim
