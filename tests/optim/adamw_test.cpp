#include <gtest/gtest.h>

#include "random_parameters.h"

#include <cmath>

#include "kernels/error.h"
#include "optim/adamw.h"

namespace qtrain::optim {
namespace {

AdamWOptions test_options() {
  AdamWOptions options;
  options.lr = 1e-2;
  options.beta1 = 0.8;
  options.beta2 = 0.95;
  options.eps = 1e-6;
  options.weight_decay = 0.1;
  return options;
}

using testing::clones;
using testing::random_parameters;

// Gives every parameter of each set the same fresh random gradient (in each set's dtype). The
// values are bf16-representable, so a bf16 set and an fp32 set see exactly the same gradient.
void set_random_grads(const std::vector<std::vector<torch::Tensor>*>& sets) {
  for (size_t i = 0; i < sets.front()->size(); ++i) {
    const auto grad = torch::randn((*sets.front())[i].sizes(), torch::kFloat).to(torch::kBFloat16).to(torch::kFloat);
    for (auto* set : sets) (*set)[i].mutable_grad() = grad.to((*set)[i].scalar_type()).to((*set)[i].device());
  }
}

TEST(AdamW, EqualsTorchAdamWBitwiseOnCpuAcrossLearningRateChanges) {
  auto ours = random_parameters(torch::kFloat, 1);
  auto theirs = clones(ours, torch::kFloat);
  const auto options = test_options();
  AdamW optimizer(ours, options);
  torch::optim::AdamW reference(theirs, torch::optim::AdamWOptions(options.lr)
                                            .betas({options.beta1, options.beta2})
                                            .eps(options.eps)
                                            .weight_decay(options.weight_decay));
  torch::manual_seed(2);
  for (int step = 0; step < 6; ++step) {
    const double lr = options.lr * (1.0 - 0.1 * step);
    optimizer.set_learning_rate(lr);
    static_cast<torch::optim::AdamWOptions&>(reference.param_groups()[0].options()).lr(lr);
    set_random_grads({&ours, &theirs});
    optimizer.step();
    reference.step();
    for (size_t i = 0; i < ours.size(); ++i) ASSERT_TRUE(torch::equal(ours[i], theirs[i])) << "step " << step << " parameter " << i;
  }
}

TEST(AdamW, SingleStepEqualsHandComputationInFloat64) {
  const auto options = test_options();
  auto parameter = torch::tensor({0.5, -1.25, 2.0, 0.0}, torch::kDouble).requires_grad_();
  const std::vector<double> initial{0.5, -1.25, 2.0, 0.0};
  const std::vector<double> grad{0.3, -0.02, 4.0, 1e-7};
  parameter.mutable_grad() = torch::tensor(grad, torch::kDouble);
  AdamW optimizer({parameter}, options);
  optimizer.step();
  for (size_t i = 0; i < grad.size(); ++i) {
    const double decayed = initial[i] * (1 - options.lr * options.weight_decay);
    const double m = (1 - options.beta1) * grad[i];
    const double v = (1 - options.beta2) * grad[i] * grad[i];
    const double bias_correction1 = 1 - options.beta1;
    const double bias_correction2 = 1 - options.beta2;
    const double expected =
        decayed - options.lr / bias_correction1 * m / (std::sqrt(v) / std::sqrt(bias_correction2) + options.eps);
    EXPECT_NEAR(parameter[i].item<double>(), expected, 1e-15) << i;
  }
}

TEST(AdamW, SkipsParametersWithoutGradients) {
  auto parameters = random_parameters(torch::kFloat, 3);
  const auto before = clones(parameters, torch::kFloat);
  AdamW optimizer(parameters, test_options());
  parameters[0].mutable_grad() = torch::ones_like(parameters[0]);
  optimizer.step();
  EXPECT_FALSE(torch::equal(parameters[0], before[0]));
  EXPECT_TRUE(torch::equal(parameters[1], before[1]));
  for (const auto& [name, tensor] : optimizer.state()) EXPECT_EQ(name.rfind("0.", 0), 0u) << name;
}

TEST(AdamW, ZeroGradSetsGradientsToUndefined) {
  auto parameters = random_parameters(torch::kFloat, 4);
  for (auto& parameter : parameters) parameter.mutable_grad() = torch::ones_like(parameter);
  AdamW optimizer(parameters, test_options());
  optimizer.zero_grad();
  for (const auto& parameter : parameters) EXPECT_FALSE(parameter.grad().defined());
}

TEST(AdamW, Bf16ParametersFollowAnFp32MasterCopy) {
  auto low = random_parameters(torch::kBFloat16, 5);
  auto full = clones(low, torch::kFloat);
  AdamW low_optimizer(low, test_options());
  AdamW full_optimizer(full, test_options());
  torch::manual_seed(6);
  for (int step = 0; step < 4; ++step) {
    set_random_grads({&low, &full});
    low_optimizer.step();
    full_optimizer.step();
  }
  const auto state = low_optimizer.state();
  for (size_t i = 0; i < low.size(); ++i) {
    const std::string master_name = std::to_string(i) + ".master";
    const auto master = std::find_if(state.begin(), state.end(), [&](const auto& entry) { return entry.first == master_name; });
    ASSERT_NE(master, state.end()) << master_name;
    EXPECT_EQ(master->second.scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::equal(master->second, full[i])) << i;
    EXPECT_TRUE(torch::equal(low[i], full[i].to(torch::kBFloat16))) << i;
  }
}

TEST(AdamW, LoadedStateContinuesExactlyLikeTheOriginal) {
  auto original = random_parameters(torch::kFloat, 7);
  original.push_back(torch::randn({9}, torch::kBFloat16).requires_grad_());
  AdamW first(original, test_options());
  torch::manual_seed(8);
  for (int step = 0; step < 2; ++step) {
    set_random_grads({&original});
    first.step();
  }
  std::vector<torch::Tensor> resumed;
  for (const auto& parameter : original) resumed.push_back(torch::zeros_like(parameter).requires_grad_());
  AdamW second(resumed, test_options());
  NamedTensors saved;
  for (const auto& [name, tensor] : first.state()) saved.emplace_back(name, tensor.clone());
  second.load_state(saved);
  // The bf16 parameter is restored from its master; the fp32 ones a checkpoint restores itself.
  EXPECT_TRUE(torch::equal(resumed.back(), original.back()));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i + 1 < original.size(); ++i) resumed[i].copy_(original[i]);
  }
  set_random_grads({&original, &resumed});
  first.step();
  second.step();
  for (size_t i = 0; i < original.size(); ++i) EXPECT_TRUE(torch::equal(original[i], resumed[i])) << i;
}

TEST(AdamW, LoadStateRejectsEntriesThatDoNotFit) {
  auto parameters = random_parameters(torch::kFloat, 9);
  AdamW optimizer(parameters, test_options());
  const auto expect_error = [&](const NamedTensors& state, const std::string& text) {
    try {
      optimizer.load_state(state);
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
    }
  };
  expect_error({{"0.exp_avg", torch::zeros({3})}}, "'0.exp_avg' has shape [3]");
  expect_error({{"7.exp_avg", torch::zeros({3})}}, "parameter 7");
  expect_error({{"0.momentum_buffer", torch::zeros({16, 8})}}, "unknown field 'momentum_buffer'");
  expect_error({{"0.exp_avg", torch::zeros({16, 8})}}, "'0.step'");
  expect_error({{"exp_avg", torch::zeros({16, 8})}}, "'exp_avg' is not named");
}

TEST(AdamW, MakeOptimizerBuildsAdamWAndRefusesWhatIsNotThere) {
  auto parameters = random_parameters(torch::kFloat, 10);
  const auto optimizer = make_optimizer("adamw", parameters, 3e-4, 0.01, {0.9, 0.98}, 1e-7);
  const auto* adamw = dynamic_cast<const AdamW*>(optimizer.get());
  ASSERT_NE(adamw, nullptr);
  EXPECT_EQ(adamw->learning_rate(), 3e-4);
  EXPECT_EQ(adamw->options().beta2, 0.98);
  EXPECT_EQ(adamw->options().eps, 1e-7);
  EXPECT_EQ(adamw->options().weight_decay, 0.01);
  EXPECT_THROW(make_optimizer("adam", parameters, 3e-4, 0.0, {0.9, 0.999}, 1e-8), Error);
  EXPECT_THROW(make_optimizer("adamw", parameters, 3e-4, 0.0, {0.9, 1.0}, 1e-8), Error);
  EXPECT_THROW(make_optimizer("adamw", parameters, -1.0, 0.0, {0.9, 0.999}, 1e-8), Error);
}

TEST(AdamW, FusedCudaStepAgreesWithTheCpuReference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    auto cpu = random_parameters(dtype, 11);
    std::vector<torch::Tensor> cuda;
    for (const auto& parameter : cpu) cuda.push_back(parameter.detach().to(torch::kCUDA).requires_grad_());
    AdamW cpu_optimizer(cpu, test_options());
    AdamW cuda_optimizer(cuda, test_options());
    torch::manual_seed(12);
    for (int step = 0; step < 5; ++step) {
      set_random_grads({&cpu, &cuda});
      cpu_optimizer.step();
      cuda_optimizer.step();
    }
    const auto cpu_state = cpu_optimizer.state();
    const auto cuda_state = cuda_optimizer.state();
    ASSERT_EQ(cpu_state.size(), cuda_state.size());
    for (size_t i = 0; i < cpu_state.size(); ++i) {
      EXPECT_EQ(cpu_state[i].first, cuda_state[i].first);
      EXPECT_TRUE(torch::allclose(cpu_state[i].second, cuda_state[i].second.cpu(), 1e-5, 1e-6)) << cpu_state[i].first;
    }
    for (size_t i = 0; i < cpu.size(); ++i) {
      // fp32: rounding of the fused kernel; bf16: at most one bf16 ulp where the master lies near a tie.
      const double tolerance = dtype == torch::kFloat ? 1e-6 : 1e-2;
      EXPECT_TRUE(torch::allclose(cpu[i].to(torch::kFloat), cuda[i].cpu().to(torch::kFloat), tolerance, tolerance)) << i;
    }
  }
}

}  // namespace
}  // namespace qtrain::optim
