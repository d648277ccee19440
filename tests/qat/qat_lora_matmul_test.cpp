// QAT-LoRA's one-pass node (qat/qat_lora_matmul.h): the merged weight it fake-quantizes against
// float64 arithmetic, its two LoRA gradients against their float64 formulas, a 4-bit base, the
// export's codes against the forward's weight, and the CUDA kernel against the CPU's bits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda_build.h"
#include "lora_layers.h"
#include "qat/four_bit_linear.h"
#include "qat/qat_linear.h"
#include "qat/qat_lora_matmul.h"
#include "quant_reference.h"

namespace qtrain::qat {
namespace {

// A trained-looking adapter (alpha = 2 rank): B is zero only at the start.
std::shared_ptr<LoraLinear> lora_layer(int64_t in, int64_t out, int64_t rank, bool bias = false) {
  return test_layers::lora_over(test_layers::dense(in, out, bias),
                                test_layers::lora_options(rank, 2.0 * static_cast<double>(rank)), 0.05);
}

QatLinearOptions weights(const QuantSpec& spec, LoraGradient gradient = LoraGradient::kIdentity) {
  QatLinearOptions options;
  options.weights.spec = spec;
  options.lora_gradient = gradient;
  return options;
}

using reference::int_spec;

// W0 + scale B A in float64, rounded once to fp32.
torch::Tensor merged_in_float64(const LoraLinear& lora, const torch::Tensor& base) {
  return (base.to(torch::kFloat64) +
          lora.scale() * torch::matmul(lora.lora_B().to(torch::kFloat64), lora.lora_A().to(torch::kFloat64)))
      .to(torch::kFloat32);
}

TEST(QatLoraMatmul, TakesLoraLayersWithDynamicIntegerScalesOnly) {
  auto lora = lora_layer(64, 16, 4);
  FakeQuantizerOptions quantizer;
  quantizer.spec = QuantSpec::gguf_q4_0();
  EXPECT_TRUE(fuses_merged_fake_quant(*lora, quantizer));
  quantizer.spec.granularity = Granularity::kPerChannel;
  EXPECT_TRUE(fuses_merged_fake_quant(*lora, quantizer));
  quantizer.spec.granularity = Granularity::kPerTensor;
  EXPECT_FALSE(fuses_merged_fake_quant(*lora, quantizer));
  quantizer.spec = QuantSpec::gguf_q4_0();
  quantizer.observer = ObserverKind::kMinMax;
  EXPECT_FALSE(fuses_merged_fake_quant(*lora, quantizer));
  quantizer.learned_scale = true;
  EXPECT_FALSE(fuses_merged_fake_quant(*lora, quantizer));
  FakeQuantizerOptions fp8;
  fp8.spec.format = QuantFormat::kFp8E4m3;
  fp8.spec.bits = 8;
  EXPECT_FALSE(fuses_merged_fake_quant(*lora, fp8));
}

// The weight the forward multiplies by is the grid's rounding of W0 + scale B A: against the
// merge in float64 rounded once, the fp32 sums move a block's min / max (so its fp32 scale) by
// ulps, which moves every value of the block by ulps (1e-6 relative), and a code only where a
// value lands on the other side of a rounding boundary: one step, in a handful of values, besides
// the block's end on symmetric grids, where absmax / s = quant_max + 0.5 is a tie by construction
// and either side of it is the same fp32 arithmetic done on a merge an ulp away.
TEST(QatLoraMatmul, ForwardWeightIsTheGridsRoundingOfTheMergedWeight) {
  torch::manual_seed(11);
  for (const auto& spec : {QuantSpec::gguf_q4_0(), int_spec(4, false, Granularity::kPerGroup, 64),
                           int_spec(3, true, Granularity::kPerGroup, 32), int_spec(4, true, Granularity::kPerChannel, 32),
                           int_spec(8, true, Granularity::kPerGroup, 128, torch::kFloat16)}) {
    SCOPED_TRACE(spec.describe());
    auto lora = lora_layer(256, 48, 8, /*bias=*/true);
    QatLinear layer(lora, weights(spec));
    const auto base = std::dynamic_pointer_cast<DenseLinear>(lora->base_layer())->weight();
    const auto merged = merged_in_float64(*lora, base);
    const auto expected = fake_quantize_values_reference(spec, merged, choose_qparams(spec, block_min_max(spec, merged)));
    const auto forward_weight = layer.dense_weight(torch::kFloat32);
    const auto differs = (forward_weight - expected.values).abs() > 1e-6 * expected.values.abs() + 1e-12;
    const auto magnitudes = merged.abs().reshape(block_view_shape(spec, merged.sizes()));
    const auto at_block_end = magnitudes.eq(std::get<0>(magnitudes.max(-1, /*keepdim=*/true))).reshape(merged.sizes());
    EXPECT_LE((differs & at_block_end.logical_not()).sum().item<int64_t>(), 3);
    const auto step = choose_qparams(spec, block_min_max(spec, merged)).scale.max().item<float>();
    EXPECT_LE((forward_weight - expected.values).abs().max().item<float>(), step * 1.0001);

    // The forward is that weight's linear map (plus the bias), and the export's codes are its bits.
    const auto x = torch::randn({5, 256});
    const auto y = layer.forward(x);
    EXPECT_TRUE(torch::allclose(y, torch::nn::functional::linear(x, forward_weight, lora->bias()), 1e-5, 1e-5));
    const auto converted = layer.convert();
    EXPECT_EQ(converted.codes.scalar_type(), torch::kInt8);
    EXPECT_TRUE(torch::equal(converted.dequantize(), forward_weight));
    const auto identity = torch::eye(256);
    const auto recovered = (layer.forward(identity) - lora->bias()).detach().t();
    EXPECT_TRUE(torch::allclose(recovered, forward_weight, 0, 1e-6));
  }
}

struct QatGradients {
  torch::Tensor input, lora_A, lora_B;
};

QatGradients run_backward(QatLinear& layer, const LoraLinear& lora, const torch::Tensor& x, const torch::Tensor& upstream) {
  auto input = x.clone().requires_grad_(true);
  layer.forward(input).backward(upstream);
  return {input.grad(), lora.lora_A().grad().clone(), lora.lora_B().grad().clone()};
}

void expect_close(const torch::Tensor& ours, const torch::Tensor& reference, const std::string& what) {
  const auto error = (ours.to(torch::kFloat64) - reference).abs().max().item<double>();
  EXPECT_LE(error, 2e-5 * (1.0 + reference.abs().max().item<double>())) << what;
}

// identity: LoRA's own low-rank gradients, dB = s G^T (X A^T), dA = s (G B)^T X; masked:
// torchao's, the merged weight's gradient G^T X zeroed where clipped, projected onto A and B.
// The input's gradient is G fq(M) in both. Reference in float64 from the same mask and weight.
TEST(QatLoraMatmul, LoraGradientsAreTheStatedStraightThroughEstimators) {
  torch::manual_seed(12);
  const auto spec = QuantSpec::int4_weight(32);
  const auto x = torch::randn({2, 7, 128});
  const auto upstream = torch::randn({2, 7, 40});
  for (const auto gradient : {LoraGradient::kIdentity, LoraGradient::kMasked}) {
    SCOPED_TRACE(lora_gradient_name(gradient));
    torch::manual_seed(13);
    auto lora = lora_layer(128, 40, 8);
    QatLinear layer(lora, weights(spec, gradient));
    const auto ours = run_backward(layer, *lora, x, upstream);

    const auto built = fake_quantize_merged(*lora, spec, torch::kFloat32, true, false, true);
    const auto X = x.reshape({-1, 128}).to(torch::kFloat64);
    const auto G = upstream.reshape({-1, 40}).to(torch::kFloat64);
    const auto A = lora->lora_A().detach().to(torch::kFloat64);
    const auto B = lora->lora_B().detach().to(torch::kFloat64);
    const double s = lora->scale();
    expect_close(ours.input.reshape({-1, 128}), torch::matmul(G, built.values.to(torch::kFloat64)), "input");
    torch::Tensor expected_A, expected_B;
    if (gradient == LoraGradient::kIdentity) {
      expected_B = s * torch::matmul(G.t(), torch::matmul(X, A.t()));
      expected_A = s * torch::matmul(torch::matmul(G, B).t(), X);
    } else {
      const auto merged_grad = torch::matmul(G.t(), X) * built.inside.to(torch::kFloat64);
      expected_B = s * torch::matmul(merged_grad, A.t());
      expected_A = s * torch::matmul(B.t(), merged_grad);
      // Something is clipped (each block's largest positive value, on a symmetric grid), so the
      // two estimators differ, and only there: at most one value per block of 32.
      const auto clipped = built.inside.logical_not().sum().item<int64_t>();
      EXPECT_GT(clipped, 0);
      EXPECT_LE(clipped, 40 * 128 / 32);
    }
    expect_close(ours.lora_A, expected_A, "lora_A");
    expect_close(ours.lora_B, expected_B, "lora_B");
  }
}

// A frozen NF4 base: what is merged is the base as QLoRA's forward dequantizes it.
TEST(QatLoraMatmul, FourBitBaseMergesItsDequantizedWeight) {
  torch::manual_seed(14);
  auto base = test_layers::fp32_four_bit_base(32, 128);
  auto lora = test_layers::lora_over(base, test_layers::lora_options(4, /*alpha=*/32), 0.05);
  const auto spec = QuantSpec::gguf_q4_0();
  QatLinear layer(lora, weights(spec));
  const auto merged = merged_in_float64(*lora, base->dense_weight(base->quant_state().dtype));
  const auto expected = fake_quantize_values_reference(spec, merged, choose_qparams(spec, block_min_max(spec, merged)));
  const auto forward_weight = layer.dense_weight(torch::kFloat32);
  EXPECT_LE(((forward_weight - expected.values).abs() > 1e-6 * expected.values.abs() + 1e-12).sum().item<int64_t>(), 2);
  EXPECT_TRUE(torch::equal(layer.convert().dequantize(), layer.dense_weight(torch::kFloat32)));
  const auto x = torch::randn({3, 128}).requires_grad_(true);
  layer.forward(x).sum().backward();
  EXPECT_TRUE(lora->lora_A().grad().abs().sum().item<float>() > 0);
  EXPECT_TRUE(x.grad().defined());
}

// The CUDA kernel against the CPU's torch operations, bit for bit: values, codes, scales, zero
// points and the mask, for every layout (tiled groups, per-channel rows, odd groups) and grid.
TEST(QatLoraMatmulCuda, KernelGivesTheCpusBits) {
  if (!kernels::kCudaKernelsBuilt || !torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA GPU";
  torch::manual_seed(15);
  struct Case {
    QuantSpec spec;
    int64_t rank;
    torch::ScalarType base_dtype;
  };
  const std::vector<Case> cases = {
      {QuantSpec::gguf_q4_0(), 16, torch::kBFloat16},
      {QuantSpec::gguf_q8_0(), 8, torch::kFloat32},
      {int_spec(4, false, Granularity::kPerGroup, 64), 16, torch::kBFloat16},
      {int_spec(3, true, Granularity::kPerGroup, 128), 64, torch::kFloat16},
      {int_spec(2, true, Granularity::kPerGroup, 256), 8, torch::kBFloat16},
      {int_spec(4, true, Granularity::kPerGroup, 256), 64, torch::kBFloat16},  // A's slice past shared memory
      {int_spec(4, true, Granularity::kPerChannel, 32), 16, torch::kBFloat16},
      {int_spec(4, false, Granularity::kPerGroup, 96), 4, torch::kFloat32},
  };
  for (const auto& test : cases) {
    SCOPED_TRACE(test.spec.describe() + " rank " + std::to_string(test.rank));
    DenseLinearOptions dense;
    dense.in_features = 768;
    dense.out_features = 136;  // not a multiple of the 64-row tile
    dense.dtype = test.base_dtype;
    LoraOptions options;
    options.rank = test.rank;
    auto cpu = std::make_shared<LoraLinear>(std::make_shared<DenseLinear>(dense), options);
    {
      torch::NoGradGuard no_grad;
      auto weight = std::dynamic_pointer_cast<DenseLinear>(cpu->base_layer())->weight();
      weight.copy_(torch::randn(weight.sizes()) * 0.02);
      weight.index_put_({3, 5}, 0.9);  // an outlier
      weight.index_put_({7}, 0.0);     // an all-zero row (but for B A)
      cpu->lora_B().normal_(0.0, 0.02);
    }
    auto gpu = std::make_shared<LoraLinear>(std::make_shared<DenseLinear>(dense), options);
    gpu->to(torch::kCUDA);
    {
      torch::NoGradGuard no_grad;
      for (const auto& item : cpu->named_parameters()) gpu->named_parameters()[item.key()].copy_(item.value());
    }
    const auto ours = fake_quantize_merged(*gpu, test.spec, torch::kBFloat16, true, true, true);
    const auto reference = fake_quantize_merged(*cpu, test.spec, torch::kBFloat16, true, true, true);
    EXPECT_TRUE(torch::equal(ours.values.cpu(), reference.values));
    EXPECT_TRUE(torch::equal(ours.quantized.codes.cpu(), reference.quantized.codes));
    EXPECT_TRUE(torch::equal(ours.quantized.params.scale.cpu(), reference.quantized.params.scale));
    EXPECT_TRUE(torch::equal(ours.quantized.params.zero_point.cpu(), reference.quantized.params.zero_point));
    EXPECT_TRUE(torch::equal(ours.inside.cpu(), reference.inside));
  }
}

// On the GPU the node's gradients are the CPU's up to the matmuls' rounding.
TEST(QatLoraMatmulCuda, GradientsMatchTheCpu) {
  if (!kernels::kCudaKernelsBuilt || !torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA GPU";
  const auto spec = QuantSpec::gguf_q4_0();
  const auto x = torch::randn({3, 5, 256});
  const auto upstream = torch::randn({3, 5, 64});
  for (const auto gradient : {LoraGradient::kIdentity, LoraGradient::kMasked}) {
    SCOPED_TRACE(lora_gradient_name(gradient));
    torch::manual_seed(16);
    auto cpu = lora_layer(256, 64, 16);
    torch::manual_seed(16);
    auto gpu = lora_layer(256, 64, 16);
    gpu->to(torch::kCUDA);
    QatLinear cpu_layer(cpu, weights(spec, gradient));
    QatLinear gpu_layer(gpu, weights(spec, gradient));
    const auto expected = run_backward(cpu_layer, *cpu, x, upstream);
    const auto ours = run_backward(gpu_layer, *gpu, x.cuda(), upstream.cuda());
    EXPECT_TRUE(torch::allclose(ours.input.cpu(), expected.input, 1e-4, 1e-4));
    EXPECT_TRUE(torch::allclose(ours.lora_A.cpu(), expected.lora_A, 1e-4, 1e-4));
    EXPECT_TRUE(torch::allclose(ours.lora_B.cpu(), expected.lora_B, 1e-4, 1e-4));
  }
}

}  // namespace
}  // namespace qtrain::qat
