// The gradients of fake quantization: the straight-through estimator against its definition and
// against finite differences over whole grid steps, and LSQ's scale gradient against the
// paper's formula in float64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "qat/fake_quant.h"
#include "qat/fake_quantizer.h"
#include "quant_reference.h"

namespace qtrain::qat {
namespace {

using reference::int_spec;

// Parameters for a range narrower than x's, so that part of x lies outside the grid.
QuantParams clipping_params(const QuantSpec& spec, const torch::Tensor& x, double shrink) {
  auto range = block_min_max(spec, x);
  return choose_qparams(spec, {range.min * shrink, range.max * shrink});
}

TEST(FakeQuantize, ForwardIsQuantizeThenDequantizeInTheInputsDtype) {
  const auto spec = int_spec(4, true, Granularity::kPerGroup);
  torch::manual_seed(1);
  const auto x = torch::randn({4, 64}).to(torch::kBFloat16);
  const auto params = choose_qparams(spec, block_min_max(spec, x));
  const auto y = fake_quantize(x, spec, params);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(y, fake_quantize_values(spec, x, params).values.to(torch::kBFloat16)));
}

// dL/dx = dL/dx^ where round(x / s) + z lies in [quant_min, quant_max], else 0 (the mask
// recomputed here in float64), for int and float grids.
TEST(FakeQuantize, StraightThroughGradientIsTheDefinition) {
  torch::manual_seed(2);
  for (const bool symmetric : {true, false}) {
    const auto spec = int_spec(4, symmetric, Granularity::kPerChannel);
    const auto x = torch::randn({8, 48}).requires_grad_(true);
    const auto params = clipping_params(spec, x.detach(), 0.6);
    const auto upstream = torch::randn({8, 48});
    (fake_quantize(x, spec, params) * upstream).sum().backward();

    const auto x64 = x.detach().to(torch::kFloat64);
    const auto steps = torch::round(x64 / params.scale.to(torch::kFloat64)) + params.zero_point.to(torch::kFloat64);
    const auto inside = (steps >= spec.quant_min()) & (steps <= spec.quant_max());
    const auto expected = upstream * inside.to(torch::kFloat32);
    EXPECT_TRUE(torch::equal(x.grad(), expected));
    EXPECT_GT(inside.logical_not().sum().item<int64_t>(), 10);  // the test does clip
    EXPECT_GT(inside.sum().item<int64_t>(), 100);
  }
  QuantSpec fp8;
  fp8.format = QuantFormat::kFp8E4m3;
  fp8.bits = 8;
  fp8.granularity = Granularity::kPerTensor;
  const auto x = torch::randn({256}).requires_grad_(true);
  const auto params = clipping_params(fp8, x.detach(), 0.5);
  fake_quantize(x, fp8, params).sum().backward();
  const auto inside = (x.detach().to(torch::kFloat64) / params.scale.to(torch::kFloat64)).abs() <= 448.0;
  EXPECT_TRUE(torch::equal(x.grad(), inside.to(torch::kFloat32)));
}

// Finite differences of the fake-quant function itself over a whole step, h = s: where x, x - h
// and x + h all lie on the grid's range, (fq(x + h) - fq(x - h)) / 2h = 1; where all three are
// clipped on the same side, 0. Inputs sit at least 0.1 step from a rounding tie, so the
// rounding of x + h in fp32 cannot change which grid point it lands on.
TEST(FakeQuantize, StraightThroughGradientMatchesFiniteDifferencesOverWholeSteps) {
  torch::manual_seed(3);
  const auto spec = int_spec(4, false, Granularity::kPerTensor);
  const QuantParams params{torch::full({1}, 0.25f), torch::full({1}, -3.0f)};  // grid: x in [-1.25, 2.5]
  const auto integers = torch::randint(-14, 18, {2000}).to(torch::kFloat32);
  const auto x = ((integers + torch::rand({2000}) * 0.8 - 0.4) * 0.25).requires_grad_(true);
  fake_quantize(x, spec, params).sum().backward();

  const auto h = 0.25;
  const auto difference = (fake_quantize_values(spec, x.detach() + h, params).values -
                           fake_quantize_values(spec, x.detach() - h, params).values) /
                          (2 * h);
  const auto steps = torch::round(x.detach() / 0.25) - 3.0;  // q before clamping, for x
  const auto well_inside = (steps - 1 >= spec.quant_min()) & (steps + 1 <= spec.quant_max());
  const auto well_outside = (steps - 1 > spec.quant_max()) | (steps + 1 < spec.quant_min());
  EXPECT_GT(well_inside.sum().item<int64_t>(), 500);
  EXPECT_GT(well_outside.sum().item<int64_t>(), 100);
  EXPECT_TRUE(torch::allclose(difference.masked_select(well_inside), x.grad().masked_select(well_inside), 0, 1e-5));
  EXPECT_TRUE(torch::allclose(difference.masked_select(well_outside), x.grad().masked_select(well_outside), 0, 1e-5));
  EXPECT_TRUE(torch::equal(x.grad().masked_select(well_inside), torch::ones({well_inside.sum().item<int64_t>()})));
  EXPECT_TRUE(torch::equal(x.grad().masked_select(well_outside), torch::zeros({well_outside.sum().item<int64_t>()})));
}

// LSQ (Esser et al. 2020, eq. 3 and the gradient scale of section 2.2), in float64 from the
// paper: dx^/ds = round(v/s) - v/s inside (-Qn, Qp), -Qn below, Qp above; dx^/dv = 1 inside.
TEST(LearnedScale, GradientsMatchThePaper) {
  torch::manual_seed(4);
  for (const bool symmetric : {true, false}) {
    const auto spec = int_spec(3, symmetric, Granularity::kPerGroup, 16);
    const auto x = torch::randn({4, 64}).requires_grad_(true);
    const auto initial = clipping_params(spec, x.detach(), 0.7);
    const auto scale = initial.scale.clone().requires_grad_(true);
    const auto zero_point = initial.zero_point;
    const double g = lsq_gradient_scale(spec, 16);
    const auto upstream = torch::randn({4, 64});
    const auto y = fake_quantize_learned_scale(x, scale, zero_point, spec, g);
    EXPECT_TRUE(torch::equal(y, fake_quantize_values(spec, x.detach(), initial).values));
    (y * upstream).sum().backward();

    const auto blocks = reference::blocks_of(spec, x.detach());
    const auto upstream_blocks = reference::blocks_of(spec, upstream);
    const auto scale64 = scale.detach().to(torch::kFloat64).flatten();
    const auto zero64 = zero_point.to(torch::kFloat64).flatten();
    const auto grad_scale = scale.grad().to(torch::kFloat64).flatten();
    const auto grad_x = x.grad().to(torch::kFloat64).flatten();
    const double positive_end = symmetric ? spec.quant_max() : spec.quant_max() - spec.quant_min();
    EXPECT_DOUBLE_EQ(g, 1.0 / std::sqrt(16.0 * positive_end));
    int64_t index = 0, clipped = 0;
    for (size_t block = 0; block < blocks.size(); ++block) {
      const double s = scale64[block].item<double>();
      const double low = spec.quant_min() - zero64[block].item<double>();  // -Qn
      const double high = spec.quant_max() - zero64[block].item<double>();  // Qp
      double expected_grad_scale = 0.0;
      for (size_t element = 0; element < blocks[block].size(); ++element, ++index) {
        const double v = blocks[block][element] / s;
        const double upstream_value = upstream_blocks[block][element];
        const bool inside = v > low && v < high;
        const double derivative = inside ? std::nearbyint(v) - v : (v <= low ? low : high);
        clipped += !inside;
        expected_grad_scale += upstream_value * derivative;
        ASSERT_EQ(grad_x[index].item<double>(), inside ? upstream_value : 0.0);
      }
      expected_grad_scale *= g;
      ASSERT_NEAR(grad_scale[block].item<double>(), expected_grad_scale, 1e-5 * (1.0 + std::abs(expected_grad_scale)))
          << "block " << block;
    }
    EXPECT_GT(clipped, 5);
  }
}

TEST(LearnedScale, QuantizerUsesOneOverSqrtOfElementsTimesQp) {
  // A per-tensor weight quantizer: g = 1 / sqrt(numel * Qp), the paper's N_W.
  FakeQuantizerOptions options;
  options.spec = int_spec(4, true, Granularity::kPerTensor);
  options.learned_scale = true;
  FakeQuantizer quantizer(options, "qat.weights", {8, 32});
  torch::manual_seed(5);
  const auto w = torch::randn({8, 32});
  const auto y = quantizer.forward(w);
  ASSERT_TRUE(quantizer.learned_scale_initialized());
  // Initialised from the min-max observer's range: the dynamic scale of w.
  EXPECT_TRUE(torch::equal(quantizer.learned_scale().detach(), choose_qparams(options.spec, block_min_max(options.spec, w)).scale));
  y.sum().backward();
  const auto reference_scale = quantizer.learned_scale().detach().clone().requires_grad_(true);
  fake_quantize_learned_scale(w, reference_scale, torch::zeros({1}), options.spec, 1.0 / std::sqrt(256.0 * 7.0)).sum().backward();
  EXPECT_TRUE(torch::allclose(quantizer.learned_scale().grad(), reference_scale.grad(), 1e-6, 0));
}

TEST(LearnedScale, PaperInitialisationIsTwiceMeanAbsOverSqrtQp) {
  FakeQuantizerOptions options;
  options.spec = int_spec(4, true, Granularity::kPerChannel);
  options.learned_scale = true;
  options.learned_scale_init = LearnedScaleInit::kPaper;
  FakeQuantizer quantizer(options, "qat.weights", {4, 64});
  torch::manual_seed(6);
  const auto w = torch::randn({4, 64});
  quantizer.forward(w);
  const auto expected = 2.0 * w.to(torch::kFloat64).abs().mean(-1, true) / std::sqrt(7.0);
  EXPECT_TRUE(torch::allclose(quantizer.learned_scale().to(torch::kFloat64), expected, 1e-6, 0));
}

}  // namespace
}  // namespace qtrain::qat
