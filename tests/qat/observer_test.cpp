// Observers and the FakeQuantizer's scale sources and switches: min-max and moving-average
// ranges against their definitions, static activations, torchao-style dynamic per-token int8.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "kernels/error.h"
#include "qat/fake_quantizer.h"
#include "quant_reference.h"

namespace qtrain::qat {
namespace {

QuantSpec per_tensor_int8(bool symmetric) {
  QuantSpec spec;
  spec.bits = 8;
  spec.symmetric = symmetric;
  spec.granularity = Granularity::kPerTensor;
  return spec;
}

TEST(Observer, MinMaxKeepsTheRangeOfEverythingObserved) {
  const auto spec = per_tensor_int8(false);
  MinMaxObserver observer(spec, {1}, ObserverKind::kMinMax);
  EXPECT_FALSE(observer.has_observed());
  torch::manual_seed(1);
  const std::vector<torch::Tensor> batches = {torch::randn({2, 5, 16}), torch::randn({3, 7, 16}) * 2, torch::randn({1, 2, 16})};
  for (const auto& batch : batches) observer.observe(batch);
  const auto all = torch::cat({batches[0].flatten(), batches[1].flatten(), batches[2].flatten()});
  EXPECT_EQ(observer.min_value().item<float>(), all.min().item<float>());
  EXPECT_EQ(observer.max_value().item<float>(), all.max().item<float>());
  const auto params = observer.qparams();
  const auto expected = choose_qparams(spec, block_min_max(spec, all));
  EXPECT_TRUE(torch::equal(params.scale, expected.scale));
  EXPECT_TRUE(torch::equal(params.zero_point, expected.zero_point));
}

TEST(Observer, MovingAverageFollowsItsMomentum) {
  QuantSpec spec = per_tensor_int8(true);
  spec.granularity = Granularity::kPerChannel;
  const double momentum = 0.25;
  MinMaxObserver observer(spec, {4, 1}, ObserverKind::kMovingAverage, momentum);
  torch::manual_seed(2);
  auto expected_min = torch::Tensor(), expected_max = torch::Tensor();
  for (int step = 0; step < 5; ++step) {
    const auto x = torch::randn({4, 32}) * (1 + step);
    observer.observe(x);
    const auto batch_min = x.to(torch::kFloat64).amin(-1, true), batch_max = x.to(torch::kFloat64).amax(-1, true);
    if (step == 0) {
      expected_min = batch_min, expected_max = batch_max;  // the first observation is taken as it is
    } else {
      expected_min = expected_min + momentum * (batch_min - expected_min);
      expected_max = expected_max + momentum * (batch_max - expected_max);
    }
  }
  EXPECT_TRUE(torch::allclose(observer.min_value().to(torch::kFloat64), expected_min, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(observer.max_value().to(torch::kFloat64), expected_max, 1e-6, 1e-6));
}

TEST(Observer, QparamsBeforeAnyObservationIsAnError) {
  MinMaxObserver observer(per_tensor_int8(true), {1}, ObserverKind::kMinMax);
  EXPECT_THROW(observer.qparams(), Error);
}

// A static activation quantizer: before start_step the observer runs and the input passes
// unchanged; after, the forward quantizes with the observed range, and stops moving it once the
// observer is disabled.
TEST(FakeQuantizer, StaticActivationsObserveBeforeFakeQuantIsEnabled) {
  FakeQuantizerOptions options;
  options.spec = per_tensor_int8(false);
  options.observer = ObserverKind::kMinMax;
  FakeQuantizer quantizer(options, "qat.activations");
  quantizer.set_fake_quant_enabled(false);
  torch::manual_seed(3);
  const auto calibration = torch::randn({2, 8, 32}) * 3;
  EXPECT_TRUE(torch::equal(quantizer.forward(calibration), calibration));
  ASSERT_TRUE(quantizer.observer()->has_observed());

  quantizer.set_fake_quant_enabled(true);
  quantizer.set_observer_enabled(false);
  const auto x = torch::randn({1, 4, 32}) * 5;  // wider than the calibration: clipped
  const auto expected_params = choose_qparams(options.spec, block_min_max(options.spec, calibration));
  EXPECT_TRUE(torch::equal(quantizer.forward(x), fake_quantize_values(options.spec, x, expected_params).values));
  EXPECT_EQ(quantizer.observer()->max_value().item<float>(), calibration.max().item<float>());
}

// torchao's Int8DynActInt4Weight activations: per token, asymmetric int8 in [-128, 127], scale
// and zero point from that token's own min / max on every call; checked against the float64
// reference of choose_qparams_affine (to two fp32 roundings: the scale's and the product's).
TEST(FakeQuantizer, DynamicPerTokenInt8MatchesTheReference) {
  FakeQuantizerOptions options;
  options.spec = QuantSpec::int8_dynamic_per_token_activation();
  FakeQuantizer quantizer(options, "qat.activations");
  torch::manual_seed(4);
  for (const auto& shape : {std::vector<int64_t>{2, 3, 64}, std::vector<int64_t>{5, 64}}) {
    const auto x = torch::randn(shape) + 0.5;
    const auto y = quantizer.forward(x).to(torch::kFloat64).reshape({-1, 64});
    const auto rows = x.reshape({-1, 64});
    for (int64_t row = 0; row < rows.size(0); ++row) {
      const auto values = reference::blocks_of(options.spec, rows[row].unsqueeze(0))[0];
      const auto params = reference::int_params(options.spec, values);
      for (int64_t column = 0; column < 64; ++column) {
        const auto code = reference::int_code(options.spec, values[column], params);
        if (code.near_tie) continue;
        const double expected = (code.q - params.zero_point) * params.scale;
        ASSERT_NEAR(y[row][column].item<double>(), expected, 2.5e-7 * std::abs(expected) + 1e-6 * params.scale) << "row " << row << " column " << column;
      }
    }
  }
}

TEST(FakeQuantizer, ActivationsWithAStaticRangeMustBePerTensor) {
  FakeQuantizerOptions options;
  options.spec = QuantSpec::int8_dynamic_per_token_activation();
  options.observer = ObserverKind::kMovingAverage;
  try {
    FakeQuantizer quantizer(options, "qat.activations");
    FAIL() << "expected an Error";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()).rfind("qat.activations.granularity: per_token cannot keep an observed range", 0), 0u)
        << error.what();
  }
  options.observer = ObserverKind::kDynamic;
  options.learned_scale = true;
  EXPECT_THROW(FakeQuantizer(options, "qat.activations"), Error);
  options.learned_scale = false;
  options.spec.format = QuantFormat::kFp8E4m3;
  options.spec.symmetric = true;
  options.spec.granularity = Granularity::kPerTensor;
  options.learned_scale = true;
  try {
    FakeQuantizer quantizer(options, "qat.activations");
    FAIL() << "expected an Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("qat.activations.learned_scale"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::qat
