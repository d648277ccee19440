#include <gtest/gtest.h>

#include "random_parameters.h"

#include "kernels/error.h"
#include "optim/sgd.h"

namespace qtrain::optim {
namespace {

using testing::clones;
using testing::random_parameters;

// The same fresh random gradient for both sets, bf16-representable so bf16 and fp32 sets agree.
void set_random_grads(std::vector<torch::Tensor>& first, std::vector<torch::Tensor>& second) {
  for (size_t i = 0; i < first.size(); ++i) {
    const auto grad = torch::randn(first[i].sizes()).to(torch::kBFloat16).to(torch::kFloat);
    first[i].mutable_grad() = grad.to(first[i].scalar_type());
    second[i].mutable_grad() = grad.to(second[i].scalar_type());
  }
}

TEST(Sgd, EqualsTorchSgdBitwiseOnCpu) {
  const std::vector<SgdOptions> configurations{
      {0.1, 0.0, 0.0, false}, {0.1, 0.9, 0.0, false}, {0.05, 0.9, 0.01, false}, {0.05, 0.8, 0.01, true}};
  for (const auto& options : configurations) {
    auto ours = random_parameters(torch::kFloat, 1);
    auto theirs = clones(ours, torch::kFloat);
    Sgd optimizer(ours, options);
    torch::optim::SGD reference(theirs, torch::optim::SGDOptions(options.lr)
                                            .momentum(options.momentum)
                                            .weight_decay(options.weight_decay)
                                            .nesterov(options.nesterov));
    torch::manual_seed(2);
    for (int step = 0; step < 5; ++step) {
      set_random_grads(ours, theirs);
      optimizer.step();
      reference.step();
    }
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(torch::equal(ours[i], theirs[i])) << "momentum " << options.momentum << " nesterov "
                                                    << options.nesterov << " parameter " << i;
    }
  }
}

TEST(Sgd, Bf16ParametersFollowAnFp32MasterCopy) {
  SgdOptions options{0.01, 0.9, 0.0, false};
  auto low = random_parameters(torch::kBFloat16, 3);
  auto full = clones(low, torch::kFloat);
  Sgd low_optimizer(low, options);
  Sgd full_optimizer(full, options);
  torch::manual_seed(4);
  for (int step = 0; step < 4; ++step) {
    set_random_grads(low, full);
    low_optimizer.step();
    full_optimizer.step();
  }
  for (size_t i = 0; i < low.size(); ++i) EXPECT_TRUE(torch::equal(low[i], full[i].to(torch::kBFloat16))) << i;
}

TEST(Sgd, LoadedStateContinuesExactlyLikeTheOriginal) {
  SgdOptions options{0.05, 0.9, 0.01, true};
  auto original = random_parameters(torch::kFloat, 5);
  auto resumed = clones(original, torch::kFloat);
  Sgd first(original, options);
  auto unused = clones(original, torch::kFloat);
  torch::manual_seed(6);
  for (int step = 0; step < 2; ++step) {
    set_random_grads(original, unused);
    first.step();
  }
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < original.size(); ++i) resumed[i].copy_(original[i]);
  }
  Sgd second(resumed, options);
  second.load_state(first.state());
  EXPECT_EQ(first.state().size(), original.size());
  set_random_grads(original, resumed);
  first.step();
  second.step();
  for (size_t i = 0; i < original.size(); ++i) EXPECT_TRUE(torch::equal(original[i], resumed[i])) << i;
}

TEST(Sgd, RejectsNesterovWithoutMomentumAndNegativeSettings) {
  const auto parameters = random_parameters(torch::kFloat, 7);
  EXPECT_THROW(Sgd(parameters, SgdOptions{0.1, 0.0, 0.0, true}), Error);
  EXPECT_THROW(Sgd(parameters, SgdOptions{0.1, -0.5, 0.0, false}), Error);
  EXPECT_THROW(Sgd(parameters, SgdOptions{-0.1, 0.0, 0.0, false}), Error);
}

TEST(Sgd, MakeOptimizerBuildsSgdWithMomentum) {
  const auto optimizer = make_optimizer("sgd", random_parameters(torch::kFloat, 8), 0.1, 0.01, {0.9, 0.999}, 1e-8, 0.9);
  const auto* sgd = dynamic_cast<const Sgd*>(optimizer.get());
  ASSERT_NE(sgd, nullptr);
  EXPECT_EQ(sgd->learning_rate(), 0.1);
  EXPECT_EQ(sgd->options().momentum, 0.9);
  EXPECT_EQ(sgd->options().weight_decay, 0.01);
}

}  // namespace
}  // namespace qtrain::optim
