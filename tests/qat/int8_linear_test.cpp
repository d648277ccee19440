// LLM.int8's numerics on fresh random inputs against float64 references (bitsandbytes' own
// outputs are checked in tests/trainer/int8_reference_test.cpp): the mixed-precision product, the
// edge rows, the frozen layer's buffers and dtype moves.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/error.h"
#include "qat/int8_codec.h"
#include "qat/int8_linear.h"

namespace qtrain::qat {
namespace {

// [rows, 96] activations of scale 1 with two outlier columns (values around 20).
torch::Tensor activations(int64_t rows) {
  auto input = torch::randn({rows, 96});
  input.index_put_({torch::indexing::Slice(), 5}, torch::randn({rows}) * 20);
  input.index_put_({torch::indexing::Slice(), 60}, torch::randn({rows}) * 20);
  return input.to(torch::kHalf);
}

// The decomposition in float64 from the codes the quantizer chose: inlier columns as
// CA CB^T * SCA SCB / 127^2, outlier columns as x W_deq^T, plus the bias.
TEST(Int8Codec, MixedMatmulEqualsTheDecompositionInFloat64) {
  torch::manual_seed(1);
  const auto input = activations(40);
  const auto weight = torch::randn({48, 96}) * 0.05;
  const auto bias = torch::randn({48}).to(torch::kHalf);
  const auto quantized_weight = int8_vectorwise_quantize(weight, 0.0);
  const auto output = int8_mixed_matmul(input, quantized_weight.codes, quantized_weight.absmax, bias, 6.0);
  ASSERT_EQ(output.scalar_type(), torch::kHalf);

  const auto rows = int8_vectorwise_quantize(input, 6.0);
  ASSERT_EQ(rows.outlier_cols.numel(), 2);
  const auto codes = rows.codes.to(torch::kDouble), weight_codes = quantized_weight.codes.to(torch::kDouble);
  auto expected = codes.mm(weight_codes.t()) * rows.absmax.to(torch::kDouble).unsqueeze(1) *
                  quantized_weight.absmax.to(torch::kDouble).unsqueeze(0) / (127.0 * 127.0);
  const auto dequantized = weight_codes * quantized_weight.absmax.to(torch::kDouble).unsqueeze(1) / 127.0;
  const auto outliers = rows.outlier_cols;
  expected += input.to(torch::kDouble).index_select(1, outliers).mm(dequantized.index_select(1, outliers).t());
  expected += bias.to(torch::kDouble).unsqueeze(0);
  // Two fp16 roundings (the int8 part, then the sum) and the fp16 weight of the outlier part.
  const auto difference = (output.to(torch::kDouble) - expected).abs();
  EXPECT_LE((difference - expected.abs() * 3e-3).max().item<double>(), 1e-3);
  // And the decomposition is close to the unquantized product (int8 keeps about 1% of each row).
  const auto exact = input.to(torch::kDouble).mm(weight.to(torch::kDouble).t()) + bias.to(torch::kDouble);
  EXPECT_LT((output.to(torch::kDouble) - exact).abs().max().item<double>(), 0.05 * exact.abs().max().item<double>());
}

TEST(Int8Codec, ZeroAndAllOutlierRowsQuantizeToZeroCodes) {
  auto input = torch::randn({4, 16});
  input[1].zero_();
  input[2].fill_(10.0);
  const auto quantized = int8_vectorwise_quantize(input, 6.0);
  EXPECT_EQ(quantized.codes[1].abs().sum().item<int64_t>(), 0);
  EXPECT_EQ(quantized.codes[2].abs().sum().item<int64_t>(), 0);
  EXPECT_EQ(quantized.outlier_cols.numel(), 16);  // row 2 makes every column an outlier column
  EXPECT_THROW(int8_vectorwise_quantize(input, -1.0), Error);
}

TEST(Int8Linear, KeepsInt8CodesThroughDtypeMovesAndHasNoParameters) {
  Int8Options options;
  options.compute_dtype = torch::kFloat;
  auto layer = Int8Linear::from_dense(torch::randn({32, 64}), torch::randn({32}), options);
  layer->to(torch::kBFloat16);
  EXPECT_EQ(layer->codes().scalar_type(), torch::kChar);
  EXPECT_EQ(layer->absmax().scalar_type(), torch::kFloat);
  EXPECT_EQ(layer->bias().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(layer->parameters().empty());
  std::vector<std::string> buffers;
  for (const auto& item : layer->named_buffers()) buffers.push_back(item.key());
  EXPECT_EQ(buffers, (std::vector<std::string>{"weight", "SCB", "bias"}));
  const auto output = layer->forward(torch::randn({3, 5, 64}).to(torch::kBFloat16));
  EXPECT_EQ(output.sizes(), (std::vector<int64_t>{3, 5, 32}));
  EXPECT_EQ(output.scalar_type(), torch::kBFloat16);
}

// Without a bias (the Llama projections), forward and backward run; the input's gradient is
// dy dequantize(W), in float64 here.
TEST(Int8Linear, WithoutBiasGradientsFlowThroughTheDequantizedWeight) {
  Int8Options options;
  auto layer = Int8Linear::from_dense(torch::randn({24, 40}), torch::Tensor(), options);
  auto input = torch::randn({2, 3, 40}).requires_grad_();
  const auto grad_output = torch::randn({2, 3, 24});
  layer->forward(input).backward(grad_output);
  const auto weight = layer->codes().to(torch::kDouble) * layer->absmax().to(torch::kDouble).unsqueeze(1) / 127.0;
  const auto expected = grad_output.to(torch::kDouble).reshape({-1, 24}).mm(weight).view({2, 3, 40});
  EXPECT_LE((input.grad().to(torch::kDouble) - expected).abs().max().item<double>(), 1e-5);
}

TEST(Int8Linear, MismatchedCodesAndScalesAreErrorsNamingWhatWasExpected) {
  const auto codes = torch::zeros({8, 16}, torch::kChar);
  try {
    Int8Linear(codes, torch::ones({7}), torch::Tensor(), 6.0, torch::kFloat, "m.q_proj");
    FAIL();
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("m.q_proj: SCB must hold one fp32 absmax per weight row: 8"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(Int8Linear(codes.to(torch::kFloat), torch::ones({8}), torch::Tensor(), 6.0, torch::kFloat), Error);
  EXPECT_THROW(Int8Linear(codes, torch::ones({8}), torch::Tensor(), -0.5, torch::kFloat), Error);
}

}  // namespace
}  // namespace qtrain::qat
