#include <gtest/gtest.h>

#include <cmath>

#include "optim/grad_clip.h"

namespace qtrain::optim {
namespace {

// Parameters of several shapes with random gradients, and an identical deep copy of them.
std::vector<torch::Tensor> parameters_with_grads(torch::Dtype dtype, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> parameters;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{7, 5}, {33}, {4, 3, 2}}) {
    auto parameter = torch::randn(shape, torch::dtype(dtype)).requires_grad_();
    parameter.mutable_grad() = torch::randn(shape, torch::dtype(dtype)) * 3;
    parameters.push_back(parameter);
  }
  return parameters;
}

std::vector<torch::Tensor> copy_of(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> copies;
  for (const auto& parameter : parameters) {
    auto copy = parameter.detach().clone().requires_grad_();
    copy.mutable_grad() = parameter.grad().clone();
    copies.push_back(copy);
  }
  return copies;
}

TEST(ClipGradNorm, EqualsTorchClipGradNormBitwiseOnCpu) {
  for (const double max_norm : {0.5, 1e6}) {
    auto ours = parameters_with_grads(torch::kFloat, 3);
    auto theirs = copy_of(ours);
    const double our_norm = clip_grad_norm(ours, max_norm);
    const double their_norm = torch::nn::utils::clip_grad_norm_(theirs, max_norm);
    EXPECT_EQ(our_norm, their_norm);
    for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(torch::equal(ours[i].grad(), theirs[i].grad())) << i;
  }
}

TEST(ClipGradNorm, ReturnsTheNormBeforeClippingAndScalesByMaxNormOverNorm) {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  a.mutable_grad() = torch::tensor({3.0f, 4.0f});
  b.mutable_grad() = torch::tensor({12.0f});
  const double norm = clip_grad_norm({a, b}, 1.3);  // sqrt(9 + 16 + 144) = 13
  EXPECT_NEAR(norm, 13.0, 1e-6);
  const double coefficient = 1.3 / (13.0 + 1e-6);
  EXPECT_NEAR(a.grad()[0].item<double>(), 3.0 * coefficient, 1e-6);
  EXPECT_NEAR(a.grad()[1].item<double>(), 4.0 * coefficient, 1e-6);
  EXPECT_NEAR(b.grad()[0].item<double>(), 12.0 * coefficient, 1e-6);
}

TEST(ClipGradNorm, LeavesGradientsAloneBelowMaxNormOrWithoutMaxNorm) {
  for (const double max_norm : {0.0, -1.0, 1e9}) {
    auto parameters = parameters_with_grads(torch::kFloat, 4);
    const auto before = copy_of(parameters);
    const double norm = clip_grad_norm(parameters, max_norm);
    EXPECT_GT(norm, 1.0);
    for (size_t i = 0; i < parameters.size(); ++i) EXPECT_TRUE(torch::equal(parameters[i].grad(), before[i].grad()));
  }
}

TEST(ClipGradNorm, AccumulatesBf16GradientsInFp32) {
  auto parameters = parameters_with_grads(torch::kBFloat16, 5);
  double sum_of_squares = 0.0;
  for (const auto& parameter : parameters) sum_of_squares += parameter.grad().to(torch::kDouble).square().sum().item<double>();
  const double norm = clip_grad_norm(parameters, 0.0);
  EXPECT_NEAR(norm, std::sqrt(sum_of_squares), 1e-6 * std::sqrt(sum_of_squares));
}

TEST(ClipGradNorm, IgnoresParametersWithoutGradients) {
  auto with_grad = torch::zeros({2}, torch::requires_grad());
  with_grad.mutable_grad() = torch::tensor({6.0f, 8.0f});
  const auto without_grad = torch::ones({3}, torch::requires_grad());
  EXPECT_NEAR(clip_grad_norm({with_grad, without_grad}, 0.0), 10.0, 1e-6);
  EXPECT_EQ(clip_grad_norm({without_grad}, 1.0), 0.0);
  EXPECT_FALSE(without_grad.grad().defined());
}

// The norm left on the device is the one clip_grad_norm reads, and the gradients are clipped the same.
TEST(ClipGradNorm, TheNormOnTheDeviceIsTheNormRead) {
  auto first = parameters_with_grads(torch::kFloat, 5);
  auto second = parameters_with_grads(torch::kFloat, 5);
  const auto norm = clip_grad_norm_on_device(first, 0.5);
  ASSERT_TRUE(norm.defined());
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.item<double>(), clip_grad_norm(second, 0.5));
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(torch::equal(first[i].grad(), second[i].grad())) << i;
  EXPECT_FALSE(clip_grad_norm_on_device({torch::zeros({2}).requires_grad_()}, 1.0).defined());
}

TEST(ClipGradNorm, CudaGradientsAgreeWithTheCpuResult) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    auto cpu = parameters_with_grads(dtype, 6);
    std::vector<torch::Tensor> cuda;
    for (const auto& parameter : cpu) {
      auto copy = parameter.detach().to(torch::kCUDA).requires_grad_();
      copy.mutable_grad() = parameter.grad().to(torch::kCUDA);
      cuda.push_back(copy);
    }
    const double cpu_norm = clip_grad_norm(cpu, 1.0);
    const double cuda_norm = clip_grad_norm(cuda, 1.0);
    EXPECT_NEAR(cuda_norm, cpu_norm, 1e-5 * cpu_norm);
    const double tolerance = dtype == torch::kFloat ? 1e-6 : 1e-2;
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(torch::allclose(cuda[i].grad().cpu().to(torch::kFloat), cpu[i].grad().to(torch::kFloat), tolerance,
                                  tolerance))
          << i;
    }
  }
}

}  // namespace
}  // namespace qtrain::optim
