// The fused LoRA matmul (qat/lora_matmul.h) against peft's composition differentiated by autograd
// in float64: y = x W^T + b + scale (x A^T) B^T and the gradients of x, A and B, for a stored dense
// base and a dequantized 4-bit one; and on CUDA in bf16 against the unfused bf16 composition.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/cuda_build.h"
#include "lora_layers.h"
#include "qat/four_bit_linear.h"
#include "qat/lora_matmul.h"
#include "tensor_support.h"

namespace qtrain::qat {
namespace {

struct Gradients {
  torch::Tensor output, input, a, b;
};

// Runs `forward` on leaf copies of x, A and B and differentiates sum(output * weights).
template <typename Forward>
Gradients differentiate(const Forward& forward, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                        const torch::Tensor& output_weights) {
  auto input = x.detach().clone().requires_grad_(true);
  auto lora_a = a.detach().clone().requires_grad_(true);
  auto lora_b = b.detach().clone().requires_grad_(true);
  auto output = forward(input, lora_a, lora_b);
  (output.to(torch::kFloat64) * output_weights).sum().backward();
  return {output.detach(), input.grad(), lora_a.grad(), lora_b.grad()};
}

// peft's composition in float64 from the base's dense weight and bias.
Gradients reference(const LinearLayer& base, double scale, const torch::Tensor& x, const torch::Tensor& a,
                    const torch::Tensor& b, const torch::Tensor& output_weights) {
  const auto weight = base.dense_weight(torch::kFloat64);
  const auto bias = base.bias();
  return differentiate(
      [&](const torch::Tensor& input, const torch::Tensor& lora_a, const torch::Tensor& lora_b) {
        auto out = torch::matmul(input, weight.t()) + scale * torch::matmul(torch::matmul(input, lora_a.t()), lora_b.t());
        return bias.defined() ? out + bias.to(torch::kFloat64) : out;
      },
      x.to(torch::kFloat64), a.to(torch::kFloat64), b.to(torch::kFloat64), output_weights);
}

using testing::max_relative_error;
void expect_matches(const Gradients& fused, const Gradients& expected, double tolerance) {
  EXPECT_LT(max_relative_error(fused.output, expected.output), tolerance);
  EXPECT_LT(max_relative_error(fused.input, expected.input), tolerance);
  EXPECT_LT(max_relative_error(fused.a, expected.a), tolerance);
  EXPECT_LT(max_relative_error(fused.b, expected.b), tolerance);
}

std::shared_ptr<DenseLinear> frozen_dense(int64_t in, int64_t out, bool bias) {
  DenseLinearOptions options;
  options.in_features = in;
  options.out_features = out;
  options.bias = bias;
  auto layer = std::make_shared<DenseLinear>(options);
  for (auto& parameter : layer->parameters()) parameter.requires_grad_(false);
  return layer;
}

Gradients fused(const std::shared_ptr<LinearLayer>& base, double scale, const torch::Tensor& x, const torch::Tensor& a,
                const torch::Tensor& b, const torch::Tensor& output_weights) {
  return differentiate(
      [&](const torch::Tensor& input, const torch::Tensor& lora_a, const torch::Tensor& lora_b) {
        return lora_matmul(input, base, lora_a, lora_b, {scale});
      },
      x, a, b, output_weights);
}

TEST(LoraMatmul, DenseBaseWithBiasMatchesFloat64Autograd) {
  torch::manual_seed(11);
  const auto base = frozen_dense(96, 80, /*bias=*/true);
  const auto x = torch::randn({3, 7, 96});
  const auto a = torch::randn({8, 96}) * 0.1;
  const auto b = torch::randn({80, 8}) * 0.1;
  const auto weights = torch::randn({3, 7, 80}, torch::kFloat64);
  const auto result = fused(base, 2.0, x, a, b, weights);
  EXPECT_EQ(result.output.scalar_type(), torch::kFloat32);
  EXPECT_EQ(result.a.scalar_type(), torch::kFloat32);
  expect_matches(result, reference(*base, 2.0, x, a, b, weights), 2e-6);
}

using test_layers::fp32_four_bit_base;

TEST(LoraMatmul, FourBitBaseMatchesFloat64AutogradWithAndWithoutKeptWeights) {
  torch::manual_seed(12);
  const auto base = fp32_four_bit_base(64, 128);
  const auto x = torch::randn({2, 5, 128});
  const auto a = torch::randn({4, 128}) * 0.1;
  const auto b = torch::randn({64, 4}) * 0.1;
  const auto weights = torch::randn({2, 5, 64}, torch::kFloat64);
  const auto expected = reference(*base, 0.5, x, a, b, weights);
  const auto rebuilt = fused(base, 0.5, x, a, b, weights);
  expect_matches(rebuilt, expected, 2e-6);
  Gradients kept;
  {
    const KeepBuiltWeights keep(true);
    kept = fused(base, 0.5, x, a, b, weights);
  }
  EXPECT_TRUE(torch::equal(kept.input, rebuilt.input));
  EXPECT_TRUE(torch::equal(kept.a, rebuilt.a));
}

TEST(LoraMatmul, AnInputWithoutGradientStillTrainsTheAdapter) {
  torch::manual_seed(13);
  const auto base = frozen_dense(32, 16, /*bias=*/false);
  const auto x = torch::randn({4, 32});
  auto a = (torch::randn({2, 32}) * 0.1).requires_grad_(true);
  auto b = (torch::randn({16, 2}) * 0.1).requires_grad_(true);
  lora_matmul(x, base, a, b, {1.0}).sum().backward();
  ASSERT_TRUE(a.grad().defined());
  ASSERT_TRUE(b.grad().defined());
  const auto weights = torch::ones({4, 16}, torch::kFloat64);
  const auto expected = reference(*base, 1.0, x, a.detach(), b.detach(), weights);
  EXPECT_LT(max_relative_error(a.grad(), expected.a), 2e-6);
  EXPECT_LT(max_relative_error(b.grad(), expected.b), 2e-6);
}

TEST(LoraMatmul, ARetainedGraphGivesTheSameGradientsTwice) {
  torch::manual_seed(16);
  const auto base = fp32_four_bit_base(32, 64);
  auto x = torch::randn({6, 64}).requires_grad_(true);
  auto a = (torch::randn({4, 64}) * 0.1).requires_grad_(true);
  auto b = (torch::randn({32, 4}) * 0.1).requires_grad_(true);
  torch::Tensor loss;
  {
    const KeepBuiltWeights keep(true);
    loss = lora_matmul(x, base, a, b, {2.0}).pow(2).sum();
  }
  loss.backward({}, /*retain_graph=*/true);
  const auto first_x = x.grad().clone(), first_a = a.grad().clone();
  x.mutable_grad().zero_();
  a.mutable_grad().zero_();
  loss.backward();
  EXPECT_TRUE(torch::equal(x.grad(), first_x));
  EXPECT_TRUE(torch::equal(a.grad(), first_a));
}

// An input the node makes again (LinearLayer::forward_rebuilding_input: an MLP's product from its
// gate and up) is not kept from forward; the gradients equal those of the kept input bit for bit,
// with and without dropout (the same mask drops the rebuilt input).
TEST(LoraMatmul, ARebuiltInputIsNotKeptAndGivesTheSameGradientsBitwise) {
  torch::manual_seed(17);
  const auto base = fp32_four_bit_base(32, 48);
  const auto gate = torch::randn({2, 5, 48});
  const auto up = torch::randn({2, 5, 48});
  const auto a = torch::randn({4, 48}) * 0.1;
  const auto b = torch::randn({32, 4}) * 0.1;
  const auto weights = torch::randn({2, 5, 32}, torch::kFloat64);
  for (const double dropout : {0.0, 0.3}) {
    const auto run = [&](bool rebuilt) {
      auto input = (torch::silu(gate) * up).requires_grad_(true);
      auto lora_a = a.clone().requires_grad_(true);
      auto lora_b = b.clone().requires_grad_(true);
      int64_t rebuilds = 0;
      const LinearLayer::InputRebuild rebuild = [&] {
        ++rebuilds;
        return torch::silu(gate) * up;
      };
      torch::manual_seed(3);  // the same dropout mask
      const auto output = lora_matmul(input, base, lora_a, lora_b, {2.0, dropout, rebuilt ? rebuild : LinearLayer::InputRebuild()});
      // Kept: the input's storage is held by the node as well as here.
      EXPECT_EQ(input.storage().use_count() > 1, !rebuilt) << "dropout " << dropout;
      (output.to(torch::kFloat64) * weights).sum().backward();
      EXPECT_EQ(rebuilds, rebuilt ? 1 : 0);
      return Gradients{output.detach(), input.grad(), lora_a.grad(), lora_b.grad()};
    };
    const auto kept = run(false);
    const auto rebuilt = run(true);
    EXPECT_TRUE(torch::equal(rebuilt.output, kept.output)) << "dropout " << dropout;
    EXPECT_TRUE(torch::equal(rebuilt.input, kept.input)) << "dropout " << dropout;
    EXPECT_TRUE(torch::equal(rebuilt.a, kept.a)) << "dropout " << dropout;
    EXPECT_TRUE(torch::equal(rebuilt.b, kept.b)) << "dropout " << dropout;
  }
}

// An output nobody reads (LinearLayer::forward_for_graph: a recomputed layer's last projection)
// is left unwritten, and the gradients for a given output gradient equal those of the computed
// output bit for bit: on a 4-bit base (its weight built) and a stored one with a bias, kept or
// rebuilt input, with and without dropout (the same mask).
TEST(LoraMatmul, AnUnreadOutputGivesTheComputedOutputsGradientsBitwise) {
  torch::manual_seed(19);
  for (const bool four_bit : {true, false}) {
    const std::shared_ptr<LinearLayer> base = four_bit ? std::static_pointer_cast<LinearLayer>(fp32_four_bit_base(32, 48))
                                                       : std::static_pointer_cast<LinearLayer>(frozen_dense(48, 32, /*bias=*/true));
    const auto x = torch::randn({2, 5, 48});
    const auto a = torch::randn({4, 48}) * 0.1;
    const auto b = torch::randn({32, 4}) * 0.1;
    const auto grad_output = torch::randn({2, 5, 32});
    for (const double dropout : {0.0, 0.3}) {
      for (const bool rebuilt : {false, true}) {
        const auto run = [&](bool unread) {
          auto input = x.clone().requires_grad_(true);
          auto lora_a = a.clone().requires_grad_(true);
          auto lora_b = b.clone().requires_grad_(true);
          const LinearLayer::InputRebuild rebuild = [&] { return x.clone(); };
          torch::manual_seed(3);  // the same dropout mask
          const auto output =
              lora_matmul(input, base, lora_a, lora_b, {2.0, dropout, rebuilt ? rebuild : LinearLayer::InputRebuild(), unread});
          EXPECT_EQ(output.sizes(), grad_output.sizes());
          output.backward(grad_output);
          return Gradients{output.detach(), input.grad(), lora_a.grad(), lora_b.grad()};
        };
        const auto computed = run(false);
        const auto unread = run(true);
        const std::string what = std::string(four_bit ? "nf4" : "dense") + ", dropout " + std::to_string(dropout) +
                                 (rebuilt ? ", rebuilt input" : "");
        EXPECT_TRUE(torch::equal(unread.input, computed.input)) << what;
        EXPECT_TRUE(torch::equal(unread.a, computed.a)) << what;
        EXPECT_TRUE(torch::equal(unread.b, computed.b)) << what;
        ASSERT_GT(computed.a.abs().max().item<double>(), 0) << what;
      }
    }
  }
}

// Dropout acts on the adapter's input only. With A = B = I the update is the dropped input itself,
// which shows the mask; the gradients must be those of peft's composition with that mask.
TEST(LoraMatmul, DropoutMasksTheAdapterInputAndBackwardUsesTheSameMask) {
  torch::manual_seed(15);
  const auto base = frozen_dense(16, 16, /*bias=*/false);
  const auto x = torch::randn({64, 16}) + 3.0;  // no zeros: a zero in the update is a dropped value
  auto a = torch::eye(16).requires_grad_(true);
  auto b = torch::eye(16).requires_grad_(true);
  auto input = x.clone().requires_grad_(true);
  const auto weights = torch::randn({64, 16}, torch::kFloat64);
  const auto output = lora_matmul(input, base, a, b, {1.0, /*dropout=*/0.25});
  (output.to(torch::kFloat64) * weights).sum().backward();
  const auto update = output.detach() - base->forward(x);
  const auto kept = update.abs() > 1e-3;
  const double kept_fraction = kept.to(torch::kFloat64).mean().item<double>();
  EXPECT_GT(kept_fraction, 0.6);
  EXPECT_LT(kept_fraction, 0.9);
  EXPECT_LT(max_relative_error(update.masked_select(kept), (x / 0.75).masked_select(kept)), 1e-6);

  const auto mask = kept.to(torch::kFloat64) / 0.75;
  const auto expected = differentiate(
      [&](const torch::Tensor& in, const torch::Tensor& lora_a, const torch::Tensor& lora_b) {
        return torch::matmul(in, base->weight().to(torch::kFloat64).t()) +
               torch::matmul(torch::matmul(in * mask, lora_a.t()), lora_b.t());
      },
      x.to(torch::kFloat64), a.detach().to(torch::kFloat64), b.detach().to(torch::kFloat64), weights);
  EXPECT_LT(max_relative_error(input.grad(), expected.input), 2e-6);
  EXPECT_LT(max_relative_error(a.grad(), expected.a), 2e-6);
  EXPECT_LT(max_relative_error(b.grad(), expected.b), 2e-6);
}

// bf16 on the GPU: the fused path rounds less than the unfused one (the scaled update is never a
// bf16 tensor), so both are held to the float64 result, the fused one at least as closely.
TEST(LoraMatmul, CudaBf16IsAsCloseToFloat64AsTheUnfusedComposition) {
  if (!kernels::kCudaKernelsBuilt || !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  torch::manual_seed(14);
  const torch::Device cuda(torch::kCUDA, 0);
  DenseLinearOptions options;
  options.in_features = 512;
  options.out_features = 384;
  options.dtype = torch::kBFloat16;
  auto base = std::make_shared<DenseLinear>(options);
  base->to(cuda);
  for (auto& parameter : base->parameters()) parameter.requires_grad_(false);
  const auto x = torch::randn({4, 64, 512}, torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
  const auto a = torch::randn({16, 512}, torch::TensorOptions().device(cuda)) * 0.05;
  const auto b = torch::randn({384, 16}, torch::TensorOptions().device(cuda)) * 0.05;
  const auto weights = torch::randn({4, 64, 384}, torch::TensorOptions().dtype(torch::kFloat64).device(cuda));
  const auto expected = reference(*base, 2.0, x, a, b, weights);
  const auto result = fused(base, 2.0, x, a, b, weights);
  const auto unfused = differentiate(
      [&](const torch::Tensor& input, const torch::Tensor& lora_a, const torch::Tensor& lora_b) {
        const auto update = torch::nn::functional::linear(torch::nn::functional::linear(input, lora_a.to(torch::kBFloat16)),
                                                          lora_b.to(torch::kBFloat16));
        return base->forward(input) + update * 2.0;
      },
      x, a, b, weights);
  for (const auto& [actual, composed, reference_value, what] :
       {std::tuple{result.output, unfused.output, expected.output, "output"},
        std::tuple{result.input, unfused.input, expected.input, "input gradient"},
        std::tuple{result.a, unfused.a, expected.a, "A gradient"}, std::tuple{result.b, unfused.b, expected.b, "B gradient"}}) {
    const double fused_error = max_relative_error(actual, reference_value);
    EXPECT_LT(fused_error, 1e-2) << what;
    EXPECT_LE(fused_error, 1.5 * max_relative_error(composed, reference_value)) << what;
  }
}

}  // namespace
}  // namespace qtrain::qat
