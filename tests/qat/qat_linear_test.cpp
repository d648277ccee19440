// QatLinear: its forward is the linear map of the fake-quantized weight and input, gradients
// reach what trains (the weight, or LoRA's A and B through the merged weight), the switch turns
// it into the plain layer, and convert() dequantizes bit for bit to what the forward used.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <string>

#include "kernels/error.h"
#include "lora_layers.h"
#include "qat/qat_linear.h"

namespace qtrain::qat {
namespace {

using test_layers::dense;
using test_layers::lora_over;

QatLinearOptions int4_weights_int8_activations() {
  QatLinearOptions options;
  options.weights.spec = QuantSpec::int4_weight(32);
  FakeQuantizerOptions activations;
  activations.spec = QuantSpec::int8_dynamic_per_token_activation();
  options.activations = activations;
  return options;
}

std::set<std::string> parameter_names(const torch::nn::Module& module) {
  std::set<std::string> names;
  for (const auto& item : module.named_parameters()) names.insert(item.key());
  return names;
}

TEST(QatLinear, ForwardIsLinearOfFakeQuantizedWeightAndInput) {
  torch::manual_seed(1);
  auto base = dense(64, 48);
  const auto options = int4_weights_int8_activations();
  QatLinear layer(base, options);
  const auto x = torch::randn({2, 3, 64});
  const auto& weight_spec = options.weights.spec;
  const auto weight = fake_quantize_values(weight_spec, base->weight(),
                                           choose_qparams(weight_spec, block_min_max(weight_spec, base->weight())))
                          .values;
  const auto& input_spec = options.activations->spec;
  const auto input = fake_quantize_values(input_spec, x, choose_qparams(input_spec, block_min_max(input_spec, x))).values;
  EXPECT_TRUE(torch::equal(layer.forward(x), torch::nn::functional::linear(input, weight, base->bias())));
}

TEST(QatLinear, KeepsTheInnerLayersParameterNames) {
  auto layer = std::make_shared<QatLinear>(dense(32, 16), int4_weights_int8_activations());
  EXPECT_EQ(parameter_names(*layer), (std::set<std::string>{"weight", "bias"}));
  LoraOptions lora_options;
  lora_options.rank = 4;
  auto lora = std::make_shared<LoraLinear>(dense(32, 16, false), lora_options);
  QatLinearOptions learned;
  learned.weights.spec = QuantSpec::int4_weight(32);
  learned.weights.learned_scale = true;
  auto lora_layer = std::make_shared<QatLinear>(lora, learned);
  EXPECT_EQ(parameter_names(*lora_layer),
            (std::set<std::string>{"base_layer.weight", "lora_A.weight", "lora_B.weight", "weight_fake_quant.scale"}));
}

// Full fine-tuning: dL/dW = STE mask * (dL/dy)^T x.
TEST(QatLinear, WeightGradientIsStraightThrough) {
  torch::manual_seed(2);
  auto base = dense(64, 32, false);
  QatLinearOptions options;
  options.weights.spec = QuantSpec::gguf_q4_0();
  QatLinear layer(base, options);
  const auto x = torch::randn({5, 64});
  const auto upstream = torch::randn({5, 32});
  (layer.forward(x) * upstream).sum().backward();
  const auto& spec = options.weights.spec;
  const auto quantized = fake_quantize_values(spec, base->weight(), choose_qparams(spec, block_min_max(spec, base->weight())));
  const auto mask = quantized.inside.reshape({32, 64}).to(torch::kFloat32);
  EXPECT_TRUE(torch::allclose(base->weight().grad(), torch::matmul(upstream.t(), x) * mask, 1e-5, 1e-6));
}

// QAT + LoRA: the merged weight W + scale * B A is fake-quantized; A and B get gradients, W none.
TEST(QatLinear, LoraMergedWeightIsFakeQuantizedAndTrainsAdapters) {
  torch::manual_seed(3);
  auto base = dense(64, 32, true);
  auto lora = lora_over(base, test_layers::lora_options(4, 8), 0.1);
  QatLinearOptions options;
  options.weights.spec = QuantSpec::gguf_q8_0();
  // An observed range takes the composition below (dynamic integer scales take the one-pass node
  // of qat/qat_lora_matmul.h, tested in qat_lora_matmul_test.cpp); its first range is this merge's.
  options.weights.observer = ObserverKind::kMinMax;
  QatLinear layer(lora, options);
  const auto x = torch::randn({3, 64});
  const auto merged = lora->dense_weight(torch::kFloat32).detach();
  const auto& spec = options.weights.spec;
  const auto expected_weight = fake_quantize_values(spec, merged, choose_qparams(spec, block_min_max(spec, merged))).values;
  const auto y = layer.forward(x);
  EXPECT_TRUE(torch::equal(y, torch::nn::functional::linear(x, expected_weight, base->bias())));
  y.sum().backward();
  EXPECT_TRUE(lora->lora_A().grad().defined() && lora->lora_A().grad().abs().sum().item<float>() > 0);
  EXPECT_TRUE(lora->lora_B().grad().defined() && lora->lora_B().grad().abs().sum().item<float>() > 0);
  EXPECT_FALSE(base->weight().grad().defined());
}

// DoRA under QAT: what is fake-quantized is DoRA's merged weight (m / n) (W + s B A), the
// weight its merged and GGUF exports write; the magnitude trains through the rounding too.
TEST(QatLinear, DoraMergedWeightIsFakeQuantizedAndItsMagnitudeTrains) {
  torch::manual_seed(4);
  auto base = dense(64, 32, false);
  auto dora_options = test_layers::lora_options(4, 8);
  dora_options.dora = true;
  auto lora = lora_over(base, dora_options, 0.1);
  {
    torch::NoGradGuard no_grad;
    lora->lora_magnitude().mul_(1.5);  // a trained magnitude, away from the norms it starts at
  }
  QatLinearOptions options;
  options.weights.spec = QuantSpec::gguf_q4_0();
  QatLinear layer(lora, options);
  const auto merged = lora->dense_weight(torch::kFloat32).detach();
  const auto& spec = options.weights.spec;
  const auto expected_weight = fake_quantize_values(spec, merged, choose_qparams(spec, block_min_max(spec, merged))).values;
  const auto x = torch::randn({3, 64});
  const auto y = layer.forward(x);
  EXPECT_TRUE(torch::equal(y, torch::nn::functional::linear(x, expected_weight)));
  EXPECT_TRUE(torch::equal(layer.convert().dequantize(), expected_weight));
  y.pow(2).sum().backward();
  for (const auto* trained : {&lora->lora_A(), &lora->lora_B(), &lora->lora_magnitude()}) {
    EXPECT_TRUE(trained->grad().defined() && trained->grad().abs().sum().item<float>() > 0);
  }
}

TEST(QatLinear, LoraDropoutIsRefused) {
  LoraOptions lora_options;
  lora_options.dropout = 0.1;
  auto lora = std::make_shared<LoraLinear>(dense(32, 16), lora_options);
  try {
    QatLinear layer(lora, int4_weights_int8_activations());
    FAIL() << "expected an Error";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()).rfind("LoRA dropout 0.1", 0), 0u) << error.what();
  }
}

TEST(QatLinear, DisabledFakeQuantIsThePlainLayer) {
  torch::manual_seed(4);
  auto base = dense(64, 16);
  QatLinear layer(base, int4_weights_int8_activations());
  layer.set_fake_quant_enabled(false);
  const auto x = torch::randn({4, 64});
  EXPECT_TRUE(torch::equal(layer.forward(x), base->forward(x)));
  EXPECT_TRUE(torch::equal(layer.dense_weight(torch::kFloat32), base->weight()));
  layer.set_fake_quant_enabled(true);
  EXPECT_FALSE(torch::equal(layer.forward(x), base->forward(x)));
}

// convert(): codes + scales (+ zero points) dequantize to the weight the forward multiplied by,
// bit for bit, for dynamic, asymmetric, fp16-scaled and learned (after an optimizer step) scales.
TEST(QatLinear, ConvertDequantizesBitIdenticallyToTheForwardWeight) {
  torch::manual_seed(5);
  std::vector<FakeQuantizerOptions> weight_options(4);
  weight_options[0].spec = QuantSpec::int4_weight(32);
  weight_options[1].spec = QuantSpec::int4_weight(16);
  weight_options[1].spec.symmetric = false;
  weight_options[2].spec = QuantSpec::gguf_q4_0();
  weight_options[3].spec = QuantSpec::gguf_q4_0();
  weight_options[3].learned_scale = true;
  for (const auto& weights : weight_options) {
    SCOPED_TRACE(weights.spec.describe() + (weights.learned_scale ? " learned" : ""));
    auto base = dense(64, 24, false);
    QatLinearOptions options;
    options.weights = weights;
    QatLinear layer(base, options);
    torch::optim::SGD optimizer(layer.parameters(), torch::optim::SGDOptions(1e-3));
    const auto x = torch::randn({8, 64});
    layer.forward(x).pow(2).mean().backward();
    const auto scale_before = weights.learned_scale ? layer.weight_fake_quant().learned_scale().detach().clone() : torch::Tensor();
    optimizer.step();  // moves the weight and, when learned, the scale
    if (weights.learned_scale) EXPECT_FALSE(torch::equal(layer.weight_fake_quant().learned_scale(), scale_before));

    // The weight the forward uses, recovered exactly: with x = identity, y = W_q^T rows.
    const auto identity = torch::eye(64);
    const auto forward_weight = layer.forward(identity).detach().t();
    const auto converted = layer.convert();
    EXPECT_EQ(converted.codes.scalar_type(), torch::kInt8);
    EXPECT_TRUE(torch::equal(converted.dequantize(), forward_weight));
    EXPECT_TRUE(torch::equal(layer.dense_weight(torch::kFloat32), forward_weight));
    if (weights.learned_scale) {
      EXPECT_TRUE(torch::equal(converted.params.scale,
                               layer.weight_fake_quant().learned_scale().detach().to(torch::kFloat16).to(torch::kFloat32)));
    }
  }
}

TEST(QatLinear, ApplyQatWrapsTargetsOnceAndSwitchesThemTogether) {
  torch::nn::Module root;
  auto block = root.register_module("block", std::make_shared<torch::nn::Module>());
  block->register_module("q_proj", dense(32, 32));
  root.register_module("lm_head", dense(32, 8));  // all-linear leaves the output layer alone
  LoraTargets targets;
  targets.include.names = {"all-linear"};
  QatLinearOptions options;
  options.weights.spec = QuantSpec::int4_weight(32);
  EXPECT_EQ(apply_qat(root, targets, options), (std::vector<std::string>{"block.q_proj"}));
  LoraTargets again;
  again.include.names = {"q_proj"};
  EXPECT_THROW(apply_qat(root, again, options), Error);  // already QAT: nothing left to wrap
  ASSERT_EQ(find_qat_layers(root).size(), 1u);
  set_fake_quant_enabled(root, false);
  EXPECT_FALSE(find_qat_layers(root)[0].second->fake_quant_enabled());
  EXPECT_TRUE(parameter_names(root).count("block.q_proj.weight"));
}

}  // namespace
}  // namespace qtrain::qat
