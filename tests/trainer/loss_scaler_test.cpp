// The fp16 loss scaler's state machine, against torch.amp.GradScaler's documented semantics:
// initial 2^16, an overflow skips the step and halves the scale, 2000 clean steps double it.
#include "trainer/loss_scaler.h"

#include <gtest/gtest.h>

#include <limits>

#include "kernels/error.h"

namespace qtrain::trainer {
namespace {

torch::Tensor parameter_with_grad(const torch::Tensor& grad) {
  auto parameter = torch::zeros_like(grad).requires_grad_(true);
  parameter.mutable_grad() = grad.clone();
  return parameter;
}

TEST(LossScaler, StartsAtTwoToTheSixteenthAndDividesGradientsByIt) {
  LossScaler scaler(true);
  EXPECT_EQ(scaler.scale(), 65536.0);
  auto parameter = parameter_with_grad(torch::tensor({65536.0f, -131072.0f, 32.0f}));
  EXPECT_TRUE(scaler.unscale_and_check({parameter}));
  EXPECT_TRUE(torch::equal(parameter.grad(), torch::tensor({1.0f, -2.0f, 1.0f / 2048.0f})));
}

TEST(LossScaler, OverflowIsFoundAndBacksTheScaleOff) {
  LossScaler scaler(true);
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    auto clean = parameter_with_grad(torch::ones({4}));
    auto overflowed = parameter_with_grad(torch::tensor({1.0f, bad}));
    EXPECT_FALSE(scaler.unscale_and_check({clean, overflowed}));
  }
  scaler.update(/*skipped=*/true);
  EXPECT_EQ(scaler.scale(), 32768.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

// A full fine-tune in bf16 has bf16 gradients, which CUDA's fused check does not take: they are
// checked (and, were the scale not 1, unscaled) all the same, on the CPU and on a GPU.
TEST(LossScaler, Bf16GradientsAreCheckedOnEveryDevice) {
  std::vector<torch::Device> devices = {torch::kCPU};
  if (torch::cuda::is_available()) devices.emplace_back(torch::kCUDA);
  for (const auto& device : devices) {
    SCOPED_TRACE(device.str());
    const auto on = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
    LossScaler plain(false);
    auto clean = parameter_with_grad(torch::ones({4}, on));
    auto fp32 = parameter_with_grad(torch::ones({2}, torch::TensorOptions().device(device)));
    EXPECT_TRUE(plain.unscale_and_check({clean, fp32}));
    for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      auto overflowed = parameter_with_grad(torch::tensor({1.0f, bad}, on));
      EXPECT_FALSE(plain.unscale_and_check({clean, overflowed}));
    }
    LossScaler scaled(true);
    auto big = parameter_with_grad(torch::full({3}, 65536.0, on));
    EXPECT_TRUE(scaled.unscale_and_check({big}));
    EXPECT_TRUE(torch::equal(big.grad().cpu(), torch::ones({3}, torch::kBFloat16)));
  }
}

TEST(LossScaler, GrowsAfterTheIntervalOfCleanStepsAndAnOverflowRestartsTheCount) {
  LossScaler scaler(true);
  for (int step = 0; step < 1999; ++step) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 65536.0);
  scaler.update(true);  // the 2000th step overflows: the count starts again
  EXPECT_EQ(scaler.scale(), 32768.0);
  for (int step = 0; step < 1999; ++step) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 32768.0);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(LossScaler, StateRoundTripsAndDisabledScalersStayAtOne) {
  LossScaler scaler(true);
  scaler.update(true);
  for (int step = 0; step < 7; ++step) scaler.update(false);
  LossScaler restored(true);
  restored.load_state(nlohmann::json::parse(scaler.state().dump()), "state.json");
  EXPECT_EQ(restored.scale(), 32768.0);
  EXPECT_EQ(restored.growth_tracker(), 7);
  EXPECT_THROW(restored.load_state({{"scale", -1}, {"growth_tracker", 0}}, "state.json"), Error);

  LossScaler disabled(false);
  disabled.update(true);
  EXPECT_EQ(disabled.scale(), 1.0);
  auto parameter = parameter_with_grad(torch::tensor({3.0f, std::numeric_limits<float>::infinity()}));
  EXPECT_FALSE(disabled.unscale_and_check({parameter}));  // the NaN policy still sees it
}

}  // namespace
}  // namespace qtrain::trainer
