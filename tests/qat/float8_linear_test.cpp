// The FP8 base (qat/float8_linear.h) on fresh random inputs: the row quantizer against the e4m3
// grid in float64, the matmuls against float64 products of the quantized operands and of the
// unquantized ones, the layer standalone and under a LoRA adapter; a 4-bit base multiplied on FP8
// tensor cores. On a GPU with FP8 tensor cores (skipped elsewhere): the CUDA quantizer and the
// 4-bit-to-e4m3 kernel byte for byte against the torch operations, and the tensor-core matmuls
// (with and without accumulating onto the output) against the reference path.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/error.h"
#include "kernels/float8_gemm.h"
#include "kernels/float8_rows.h"
#include "lora_layers.h"
#include "qat/float8_codec.h"
#include "qat/float8_linear.h"
#include "qat/float8_matmul.h"
#include "qat/four_bit_linear.h"
#include "qat/four_bit_codec.h"
#include "qat/lora_linear.h"

namespace qtrain::qat {
namespace {

using torch::indexing::Slice;

torch::Tensor as_double(const torch::Tensor& tensor) { return tensor.to(torch::kCPU, torch::kDouble); }

// Every finite e4m3fn value, from its 256 bit patterns.
torch::Tensor e4m3_grid() {
  const auto values = as_double(torch::arange(256, torch::kInt32).to(torch::kUInt8).view(torch::kFloat8_e4m3fn));
  return values.index({torch::isfinite(values)});
}

TEST(Float8Codec, EveryCodeIsTheNearestE4m3ValueAndEachRowReachesTheLargest) {
  torch::manual_seed(3);
  auto input = torch::randn({9, 40}) * torch::logspace(-3, 2, 9).unsqueeze(1);  // rows of very different scales
  input[4].zero_();
  const auto column_scale = torch::rand({40}) + 0.5;
  const auto quantized = quantize_rows_float8(input, column_scale);
  ASSERT_EQ(quantized.codes.scalar_type(), torch::kFloat8_e4m3fn);
  ASSERT_EQ(quantized.scales.sizes(), (std::vector<int64_t>{9, 1}));

  const auto values = as_double(input) * as_double(column_scale).unsqueeze(0);
  const auto absmax = values.abs().amax(1, true);
  const auto scales = as_double(quantized.scales);
  // The scale is the row's absmax / 448 (fp32 rounding), 1e-12 / 448 for the zero row.
  EXPECT_TRUE(torch::allclose(scales.index({torch::indexing::Slice(0, 4)}), absmax.index({Slice(0, 4)}) / 448.0, 1e-6, 0));
  EXPECT_NEAR(scales[4].item<double>(), 1e-12 / 448.0, 1e-6 * 1e-12 / 448.0);
  const auto codes = as_double(quantized.codes);
  EXPECT_EQ(codes[4].abs().max().item<double>(), 0.0);
  for (const int64_t row : {0, 3, 8}) EXPECT_EQ(codes[row].abs().max().item<double>(), 448.0) << "row " << row;
  // Each code is a grid value nearest to v / scale (ties: either neighbour at the same distance).
  const auto targets = (values / scales).reshape({-1, 1});
  const auto nearest = (targets - e4m3_grid().unsqueeze(0)).abs().amin(1);
  const auto chosen = (targets.squeeze(1) - codes.reshape({-1})).abs();
  EXPECT_LE((chosen - nearest).abs().max().item<double>(), 1e-9 * 448.0);
}

TEST(Float8Codec, ANanKeepsItsRowNan) {
  auto input = torch::randn({3, 32});
  input[1][7] = std::nan("");
  const auto quantized = quantize_rows_float8(input);
  EXPECT_TRUE(std::isnan(quantized.scales[1].item<float>()));
  EXPECT_TRUE(torch::isnan(quantized.codes[1].to(torch::kFloat)).all().item<bool>());
  EXPECT_FALSE(torch::isnan(quantized.codes.index({Slice(0, 1)}).to(torch::kFloat)).any().item<bool>());
}

// The quantized operands' product, in float64, and the unquantized one.
struct Products {
  torch::Tensor of_codes, exact;
};

Products products(const torch::Tensor& rows, const Float8Rows& weight, const torch::Tensor& dense_weight) {
  const auto quantized = quantize_rows_float8_reference(rows);
  const auto left = as_double(quantized.codes) * as_double(quantized.scales);
  const auto right = as_double(weight.codes) * as_double(weight.scales);
  return {left.mm(right.t()), as_double(rows).mm(as_double(dense_weight).t())};
}

// e4m3 keeps each operand within 2^-4 relative (half a step of 3 mantissa bits); summed over
// `in` products with independent errors the output's error is about 2^-4 * |typical product|
// * sqrt(in / 3) * sqrt(2). The bound below is 4x that, measured errors sit near 1x.
double float8_error_bound(const torch::Tensor& rows, const torch::Tensor& weight) {
  const double typical = as_double(rows).pow(2).mean().sqrt().item<double>() * as_double(weight).pow(2).mean().sqrt().item<double>();
  return 4.0 * std::ldexp(1.0, -4) * typical * std::sqrt(2.0 * static_cast<double>(rows.size(1)) / 3.0);
}

TEST(Float8Matmul, ProductIsTheQuantizedOperandsProductAndNearTheExactOne) {
  torch::manual_seed(5);
  const auto weight = torch::randn({48, 64}) * 0.05;
  const auto quantized_weight = quantize_rows_float8(weight);
  const auto rows = torch::randn({37, 64});  // 37: not a multiple of 16
  const auto output = float8_product(rows, quantized_weight);
  ASSERT_EQ(output.scalar_type(), torch::kFloat);
  const auto expected = products(rows, quantized_weight, weight);
  EXPECT_TRUE(torch::allclose(as_double(output), expected.of_codes, 1e-5, 1e-6));
  const double error = (as_double(output) - expected.exact).abs().max().item<double>();
  std::printf("fp8 product, in 64: max |error| %.3g, bound %.3g, output rms %.3g\n", error,
              float8_error_bound(rows, weight), expected.exact.pow(2).mean().sqrt().item<double>());
  EXPECT_LT(error, float8_error_bound(rows, weight));
}

TEST(Float8Matmul, InputGradientFoldsTheWeightScalesIntoTheQuantizedGradient) {
  torch::manual_seed(6);
  const auto weight = torch::randn({48, 64}) * 0.05;
  const auto quantized_weight = quantize_rows_float8(weight);
  const auto grad = torch::randn({21, 48});
  const auto result = float8_input_gradient(grad, quantized_weight);
  ASSERT_EQ(result.sizes(), (std::vector<int64_t>{21, 64}));
  // (g diag(s_W)) quantized per row, times W's codes.
  const auto folded = quantize_rows_float8_reference(grad, quantized_weight.scales.view({-1}));
  const auto expected = (as_double(folded.codes) * as_double(folded.scales)).mm(as_double(quantized_weight.codes));
  EXPECT_TRUE(torch::allclose(as_double(result), expected, 1e-5, 1e-6));
  const auto exact = as_double(grad).mm(as_double(weight));
  EXPECT_LT((as_double(result) - exact).abs().max().item<double>(), float8_error_bound(grad, weight.t()));
}

// An FP8 layer of `weight` (and `bias`, where defined) computing in fp32.
std::shared_ptr<Float8Linear> fp32_float8_layer(const torch::Tensor& weight, const torch::Tensor& bias) {
  Float8Options options;
  options.compute_dtype = torch::kFloat;
  return Float8Linear::from_dense(weight, bias, options);
}

TEST(Float8Linear, ForwardAndBackwardStandaloneWithBiasAndNoParameters) {
  torch::manual_seed(7);
  auto layer = fp32_float8_layer(torch::randn({32, 64}) * 0.1, torch::randn({32}));
  EXPECT_TRUE(layer->parameters().empty());
  std::vector<std::string> buffers;
  for (const auto& item : layer->named_buffers()) buffers.push_back(item.key());
  EXPECT_EQ(buffers, (std::vector<std::string>{"weight", "weight_scale", "bias"}));

  auto input = torch::randn({3, 5, 64}, torch::requires_grad());
  const auto output = layer->forward(input);
  ASSERT_EQ(output.sizes(), (std::vector<int64_t>{3, 5, 32}));
  const auto rows = input.detach().reshape({-1, 64});
  EXPECT_TRUE(torch::equal(output.detach().reshape({-1, 32}), layer->own_product(rows, torch::Tensor()) + layer->bias()));
  const auto grad = torch::randn({3, 5, 32});
  output.backward(grad);
  EXPECT_TRUE(torch::equal(input.grad().reshape({-1, 64}), layer->own_input_gradient(grad.reshape({-1, 32}), torch::Tensor())));

  layer->to(torch::kBFloat16);  // only the bias changes dtype
  EXPECT_EQ(layer->weight().codes.scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_EQ(layer->weight().scales.scalar_type(), torch::kFloat);
  EXPECT_EQ(layer->bias().scalar_type(), torch::kBFloat16);
  // The dense weight is codes * scale.
  EXPECT_TRUE(torch::equal(layer->dense_weight(torch::kFloat),
                           layer->weight().codes.to(torch::kFloat) * layer->weight().scales));
}

// A rank-4 adapter over `base` with a random B (a fresh one's B is zero: no update to check).
std::shared_ptr<LoraLinear> adapter_over(const std::shared_ptr<LinearLayer>& base, double dropout) {
  return test_layers::lora_over(base, test_layers::lora_options(4, 8, dropout), 0.1);
}

// Under LoRA the base's share comes from its own products; the adapter's gradients are those of
// the same adapter over any base.
// A rank-4 adapter over a [32, 64] base, forward and backward once on random rows: what the
// tests below compare with float64 products (x, A, B and the output gradient in double).
struct AdapterRun {
  std::shared_ptr<LoraLinear> lora;
  torch::Tensor input, output, grad;
  torch::Tensor x, a, b, g;
};
AdapterRun run_adapter(const std::shared_ptr<LinearLayer>& base) {
  AdapterRun run;
  run.lora = adapter_over(base, 0.0);
  run.input = torch::randn({6, 64}, torch::requires_grad());
  run.output = run.lora->forward(run.input);
  run.grad = torch::randn({6, 32});
  run.output.backward(run.grad);
  run.x = as_double(run.input.detach());
  run.a = as_double(run.lora->lora_A());
  run.b = as_double(run.lora->lora_B());
  run.g = as_double(run.grad);
  return run;
}

TEST(Float8Linear, LoraOverAnFp8BaseAddsTheBaseProductsToTheAdapters) {
  torch::manual_seed(8);
  auto base = fp32_float8_layer(torch::randn({32, 64}) * 0.1, torch::Tensor());
  const auto run = run_adapter(base);
  const auto& lora = run.lora;
  const auto &input = run.input, &output = run.output, &grad = run.grad;
  const auto &x = run.x, &a = run.a, &b = run.b, &g = run.g;
  const double scale = lora->scale();
  const auto expected_output = as_double(base->own_product(input.detach(), torch::Tensor())) + scale * x.mm(a.t()).mm(b.t());
  EXPECT_TRUE(torch::allclose(as_double(output.detach()), expected_output, 1e-5, 1e-6));
  const auto expected_input_grad = as_double(base->own_input_gradient(grad, torch::Tensor())) + scale * g.mm(b).mm(a);
  EXPECT_TRUE(torch::allclose(as_double(input.grad()), expected_input_grad, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(as_double(lora->lora_A().grad()), scale * g.mm(b).t().mm(x), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(as_double(lora->lora_B().grad()), scale * g.t().mm(x.mm(a.t())), 1e-5, 1e-6));
}

// The quantization of one input is reused by the next product with it, and never after the
// input changed in place.
TEST(Float8Matmul, AnInputChangedInPlaceIsQuantizedAgain) {
  const auto weight = quantize_rows_float8(torch::randn({16, 32}));
  auto rows = torch::randn({4, 32});
  const auto first = float8_product(rows, weight);
  EXPECT_TRUE(torch::equal(float8_product(rows, weight), first));
  rows.mul_(2.0);
  const auto doubled = float8_product(rows, weight);
  EXPECT_TRUE(torch::allclose(doubled, first * 2.0, 1e-6, 1e-6));
  EXPECT_TRUE(torch::equal(doubled, float8_product(rows.clone(), weight)));
}

// With dropout the adapter's share of forward and backward is the one over any base with the same
// mask: the same seed over the FP8 layer and over a dense copy of its weight.
TEST(Float8Linear, LoraDropoutOverAnFp8BaseMasksTheAdapterOnly) {
  torch::manual_seed(11);
  auto base = fp32_float8_layer(torch::randn({32, 64}) * 0.1, torch::Tensor());
  auto dense = std::make_shared<DenseLinear>(DenseLinearOptions{64, 32, false, torch::kFloat});
  { torch::NoGradGuard no_grad; const_cast<torch::Tensor&>(dense->weight()).copy_(base->dense_weight(torch::kFloat)); }
  const auto input = torch::randn({6, 64});
  const auto grad = torch::randn({6, 32});
  struct Run {
    torch::Tensor adapter_output, adapter_input_grad, grad_a, grad_b;
  };
  const auto run = [&](const std::shared_ptr<LinearLayer>& layer, const std::function<torch::Tensor(const torch::Tensor&)>& base_product,
                       const std::function<torch::Tensor(const torch::Tensor&)>& base_gradient) {
    torch::manual_seed(12);
    auto lora = adapter_over(layer, 0.5);
    lora->train();
    const auto x = input.clone().requires_grad_(true);
    const auto output = lora->forward(x);
    output.backward(grad);
    return Run{output.detach() - base_product(input), x.grad() - base_gradient(grad), lora->lora_A().grad(),
               lora->lora_B().grad()};
  };
  const auto fp8 = run(base, [&](const torch::Tensor& x) { return base->own_product(x, torch::Tensor()); },
                       [&](const torch::Tensor& g) { return base->own_input_gradient(g, torch::Tensor()); });
  const auto reference = run(dense, [&](const torch::Tensor& x) { return x.mm(dense->weight().t()); },
                             [&](const torch::Tensor& g) { return g.mm(dense->weight()); });
  EXPECT_TRUE(torch::allclose(fp8.adapter_output, reference.adapter_output, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(fp8.adapter_input_grad, reference.adapter_input_grad, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(fp8.grad_a, reference.grad_a, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(fp8.grad_b, reference.grad_b, 1e-5, 1e-6));
  EXPECT_GT((fp8.adapter_output != 0).sum().item<int64_t>(), 0);
}

// On the reference path `onto` receives the product added in fp32, in place.
TEST(Float8Linear, TheProductsAccumulateOntoAGivenTensorInPlace) {
  torch::manual_seed(12);
  const auto weight = quantize_rows_float8(torch::randn({32, 64}) * 0.05);
  const auto rows = torch::randn({5, 64});
  const auto onto = torch::randn({5, 32});
  auto accumulated = onto.clone();
  const auto returned = float8_product(rows, weight, false, accumulated);
  EXPECT_EQ(returned.data_ptr(), accumulated.data_ptr());
  EXPECT_TRUE(torch::allclose(accumulated, float8_product(rows, weight) + onto, 1e-6, 1e-6));
  const auto grad = torch::randn({5, 32});
  auto grad_onto = torch::randn({5, 64});
  const auto expected = float8_input_gradient(grad, weight) + grad_onto;
  float8_input_gradient(grad, weight, grad_onto);
  EXPECT_TRUE(torch::allclose(grad_onto, expected, 1e-6, 1e-6));
  auto wrong_shape = torch::zeros({5, 31});
  EXPECT_THROW(float8_product(rows, weight, false, wrong_shape), Error);
}

// A 4-bit base on FP8 tensor cores (FourBitLinear::multiply_on_float8): its e4m3 weight is the bf16
// weight the bf16 path multiplies by, quantized by row; under LoRA its products are the FP8
// products of that weight, and the checkpointed recomputation's kept weight gives the same input
// gradient as a rebuilt one.
std::shared_ptr<FourBitLinear> four_bit_on_float8(int64_t out, int64_t in, const std::string& type, bool double_quant) {
  FourBitOptions options;
  options.quant_type = type;
  options.double_quant = double_quant;
  options.compute_dtype = torch::kFloat;
  auto layer = FourBitLinear::from_dense(torch::randn({out, in}) * 0.1, torch::Tensor(), options);
  layer->multiply_on_float8(/*fast_accumulation=*/false);
  return layer;
}

TEST(FourBitOnFloat8, TheWeightIsTheBf16WeightQuantizedByRow) {
  torch::manual_seed(13);
  for (const auto& [type, double_quant] : std::vector<std::pair<std::string, bool>>{{"nf4", true}, {"fp4", false}}) {
    auto layer = four_bit_on_float8(32, 64, type, double_quant);
    const auto expected = quantize_rows_float8(layer->dense_weight(torch::kBFloat16));
    const auto codes = dequantize_4bit_to_float8(layer->packed_weight(), layer->quant_state(), expected.scales);
    EXPECT_TRUE(torch::equal(codes.view(torch::kUInt8), expected.codes.view(torch::kUInt8))) << type;
    // Its product is the FP8 product of that weight.
    const auto rows = torch::randn({5, 64});
    EXPECT_TRUE(torch::equal(layer->own_product(rows, torch::Tensor()), float8_product(rows, expected))) << type;
  }
}

TEST(FourBitOnFloat8, LoraOverItAddsTheFloat8ProductsToTheAdapters) {
  torch::manual_seed(14);
  auto base = four_bit_on_float8(32, 64, "nf4", true);
  ASSERT_TRUE(base->multiplies_itself());
  const auto run = run_adapter(base);
  const auto &input = run.input, &output = run.output, &grad = run.grad;
  const auto &x = run.x, &a = run.a, &b = run.b, &g = run.g;
  const double scale = run.lora->scale();
  const auto weight = quantize_rows_float8(base->dense_weight(torch::kBFloat16));
  EXPECT_TRUE(torch::allclose(as_double(output.detach()),
                              as_double(float8_product(input.detach(), weight)) + scale * x.mm(a.t()).mm(b.t()), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(as_double(input.grad()),
                              as_double(float8_input_gradient(grad, weight)) + scale * g.mm(b).mm(a), 1e-5, 1e-6));
  // Close to the bf16 path's product: e4m3 keeps each weight within 2^-4 of itself.
  const auto bf16_path = x.mm(as_double(base->dense_weight(torch::kFloat)).t());
  const double relative = ((as_double(base->own_product(input.detach(), torch::Tensor())) - bf16_path).abs().max() /
                           bf16_path.abs().max()).item<double>();
  EXPECT_LT(relative, 0.1);
}

TEST(FourBitOnFloat8, AKeptWeightGivesTheInputGradientOfARebuiltOne) {
  torch::manual_seed(15);
  auto layer = four_bit_on_float8(32, 64, "nf4", true);
  const auto rows = torch::randn({4, 64});
  const auto grad = torch::randn({4, 32});
  const auto rebuilt = layer->own_input_gradient(grad, torch::Tensor());
  {
    const KeepBuiltWeights keep(true);
    layer->own_product(rows, torch::Tensor());
  }
  EXPECT_TRUE(torch::equal(layer->own_input_gradient(grad, torch::Tensor()), rebuilt));
  EXPECT_THROW(four_bit_on_float8(32, 60, "nf4", true), Error);  // FP8 tensor cores take multiples of 16
}

TEST(Float8Linear, TheCpuTakesTheReferencePathWhateverTheDtype) {
  EXPECT_NO_THROW(require_float8_tensor_cores(torch::kCPU, torch::kFloat, "qlora.quant_type: fp8", "train.dtype"));
  EXPECT_FALSE(float8_tensor_cores(torch::zeros({16, 64}, torch::kBFloat16), 32));
}

bool has_float8_gpu() {
  return torch::cuda::is_available() && kernels::float8_tensor_cores(0);
}

TEST(Float8Cuda, TheKernelWritesTheTorchOperationsBytes) {
  if (!has_float8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores on this machine";
  torch::manual_seed(9);
  // 1000 and 16,392 columns take the kernel with rows in registers (and 16-byte loads), 32,776
  // (over its 32,768 bf16 values) and 1001 (not whole 16-byte vectors) the one that reads values
  // one by one, twice.
  for (const auto& [dtype, columns] : std::vector<std::pair<torch::ScalarType, int64_t>>{
           {torch::kBFloat16, 1000}, {torch::kFloat, 1000}, {torch::kBFloat16, 16392}, {torch::kBFloat16, 32776},
           {torch::kBFloat16, 1001}}) {
    auto input = (torch::randn({300, columns}) * torch::logspace(-4, 3, 300).unsqueeze(1)).to(torch::kCUDA, dtype);
    input[17].zero_();
    input[40][3] = std::nan("");
    const auto column_scale = (torch::rand({columns}) + 0.5).to(torch::kCUDA);
    for (const bool scaled : {false, true}) {
      const auto columns = scaled ? column_scale : torch::Tensor();
      const auto kernel = quantize_rows_float8(input, columns);
      const auto reference = quantize_rows_float8_reference(input, columns);
      const auto differing = (kernel.codes.view(torch::kUInt8) != reference.codes.view(torch::kUInt8)).sum().item<int64_t>();
      EXPECT_EQ(differing, 0) << c10::toString(dtype) << (scaled ? ", column scale" : "");
      // Bit for bit, but for the NaN row's payload.
      EXPECT_TRUE(torch::equal(kernel.scales.nan_to_num(-1.0).view(torch::kInt32),
                               reference.scales.nan_to_num(-1.0).view(torch::kInt32)))
          << c10::toString(dtype) << (scaled ? ", column scale" : "");
      EXPECT_TRUE(std::isnan(kernel.scales[40].item<float>()));
    }
  }
}

TEST(Float8Cuda, TheTransposeKernelEqualsTorchsTranspose) {
  if (!has_float8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores on this machine";
  for (const auto& shape : {std::vector<int64_t>{96, 256}, std::vector<int64_t>{132, 76}, std::vector<int64_t>{4, 8}}) {
    const auto codes = quantize_rows_float8(torch::randn(shape).to(torch::kCUDA)).codes;
    const auto transposed = kernels::transpose_float8_cuda(codes);
    EXPECT_TRUE(torch::equal(transposed.view(torch::kUInt8), codes.t().contiguous().view(torch::kUInt8)))
        << shape[0] << " x " << shape[1];
  }
  EXPECT_THROW(kernels::transpose_float8_cuda(quantize_rows_float8(torch::randn({6, 8}).to(torch::kCUDA)).codes), Error);
}

// The tensor cores' product and input gradient against the reference path on the same quantized
// operands (fp32 rows quantize to the same codes as their bf16 originals). Each FP8 product is
// exact; Hopper's FP8 tensor cores keep about 14 bits of the running sum (DeepSeek-V3, section
// 3.3.2), so an output may move by 2^-12 of the sum of its products' magnitudes (4x that), then
// by the bf16 rounding of the result (2^-8 relative).
void expect_within_tensor_core_rounding(const torch::Tensor& fast, const torch::Tensor& reference,
                                        const torch::Tensor& magnitudes, const std::string& what) {
  const auto difference = (as_double(fast) - as_double(reference)).abs();
  const auto allowed = std::ldexp(1.0, -8) * as_double(reference).abs() + std::ldexp(1.0, -12) * as_double(magnitudes);
  std::printf("%s: max |difference| %.3g, max difference / allowed %.3f\n", what.c_str(), difference.max().item<double>(),
              (difference / allowed).max().item<double>());
  EXPECT_TRUE((difference <= allowed).all().item<bool>()) << what;
}

torch::Tensor product_magnitudes(const Float8Rows& left, const torch::Tensor& right_codes, const torch::Tensor& right_scales) {
  return (left.codes.to(torch::kFloat).abs() * left.scales).mm((right_codes.to(torch::kFloat).abs() * right_scales).t());
}

TEST(Float8Cuda, ScaledMatmulsMatchTheReferencePath) {
  if (!has_float8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores on this machine";
  torch::manual_seed(10);
  const auto weight = quantize_rows_float8((torch::randn({96, 256}) * 0.05).to(torch::kCUDA));
  for (const int64_t tokens : {37, 256}) {
    const auto rows = torch::randn({tokens, 256}).to(torch::kCUDA, torch::kBFloat16);
    ASSERT_TRUE(float8_tensor_cores(rows, 96));
    const auto fast = float8_product(rows, weight);
    ASSERT_EQ(fast.scalar_type(), torch::kBFloat16);
    expect_within_tensor_core_rounding(fast, float8_product(rows.to(torch::kFloat), weight),
                                       product_magnitudes(quantize_rows_float8(rows), weight.codes, weight.scales),
                                       "product, " + std::to_string(tokens) + " tokens");

    const auto grad = torch::randn({tokens, 96}).to(torch::kCUDA, torch::kBFloat16);
    const auto folded = quantize_rows_float8(grad, weight.scales.view({-1}));
    expect_within_tensor_core_rounding(float8_input_gradient(grad, weight), float8_input_gradient(grad.to(torch::kFloat), weight),
                                       product_magnitudes(folded, weight.codes.t(), torch::ones({1}, weight.scales.options())),
                                       "input gradient, " + std::to_string(tokens) + " tokens");
  }
}


// cuBLASLt's FP8 matmul accumulating onto what the output holds (kernels/float8_gemm.h), as LoRA
// uses it, against the reference path's fp32 sum; 37 tokens is not a multiple of the tensor
// cores' tiles. cuBLASLt's epilogue may round the scaled product to bf16 before adding `onto`
// (measured: up to 3.3x the one-rounding bound where the sum cancels), so the bound adds one more
// bf16 rounding of the product itself: the error of the two-pass path this replaces. The kernel
// itself must run here (no fallback to torch's scaled matmul and an add on a Hopper).
TEST(Float8Cuda, ScaledMatmulsAccumulateOntoTheOutputInOnePass) {
  if (!has_float8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores on this machine";
  torch::manual_seed(11);
  const auto weight = quantize_rows_float8((torch::randn({96, 256}) * 0.05).to(torch::kCUDA));
  for (const int64_t tokens : {37, 256}) {
    const auto rows = torch::randn({tokens, 256}).to(torch::kCUDA, torch::kBFloat16);
    const auto onto = torch::randn({tokens, 96}).to(torch::kCUDA, torch::kBFloat16);
    const auto quantized = quantize_rows_float8(rows);
    auto direct = onto.clone();
    ASSERT_TRUE(kernels::float8_gemm_cuda(quantized.codes, quantized.scales, weight.codes, weight.scales, direct,
                                          /*accumulate=*/true, /*fast_accumulation=*/false));
    auto accumulated = onto.clone();
    const auto returned = float8_product(rows, weight, /*fast_accumulation=*/false, accumulated);
    EXPECT_EQ(returned.data_ptr(), accumulated.data_ptr());
    EXPECT_TRUE(torch::equal(accumulated, direct));
    const auto reference = float8_product(rows.to(torch::kFloat), weight) + onto.to(torch::kFloat);
    const auto product = float8_product(rows.to(torch::kFloat), weight).abs();
    expect_within_tensor_core_rounding(accumulated, reference,
                                       product_magnitudes(quantized, weight.codes, weight.scales) + 16 * product,
                                       "product onto, " + std::to_string(tokens) + " tokens");
    // beta = 0 overwrites whatever the output held.
    auto overwritten = torch::full({tokens, 96}, 1e4, rows.options());
    ASSERT_TRUE(kernels::float8_gemm_cuda(quantized.codes, quantized.scales, weight.codes, weight.scales, overwritten,
                                          /*accumulate=*/false, /*fast_accumulation=*/false));
    expect_within_tensor_core_rounding(overwritten, float8_product(rows.to(torch::kFloat), weight),
                                       product_magnitudes(quantized, weight.codes, weight.scales),
                                       "product over 1e4, " + std::to_string(tokens) + " tokens");

    const auto grad = torch::randn({tokens, 96}).to(torch::kCUDA, torch::kBFloat16);
    const auto grad_onto = torch::randn({tokens, 256}).to(torch::kCUDA, torch::kBFloat16);
    auto grad_accumulated = grad_onto.clone();
    float8_input_gradient(grad, weight, grad_accumulated);
    const auto folded = quantize_rows_float8(grad, weight.scales.view({-1}));
    const auto grad_product = float8_input_gradient(grad.to(torch::kFloat), weight);
    expect_within_tensor_core_rounding(
        grad_accumulated, grad_product + grad_onto.to(torch::kFloat),
        product_magnitudes(folded, weight.codes.t(), torch::ones({1}, weight.scales.options())) + 16 * grad_product.abs(),
        "input gradient onto, " + std::to_string(tokens) + " tokens");
  }
}


// The kernel from packed bytes to e4m3 codes writes the bytes of the torch path (dequantize to
// bf16, divide by the row's scale, cast), for NF4 / FP4, with and without double quantization,
// rows of 256 (its 32-values-a-thread path) and 272 (8 a thread), where two neighbouring threads
// share one block's code table, rows of 288 (32 a thread) and 264 (8 a thread), where they cannot
// (a row ends between them), and on a packed buffer that is not word-aligned (its
// one-value-at-a-time path).
TEST(Float8Cuda, TheFourBitToFloat8KernelWritesTheTorchPathsBytes) {
  if (!has_float8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores on this machine";
  torch::manual_seed(16);
  for (const auto& [type, double_quant, blocksize, columns] : std::vector<std::tuple<FourBitType, bool, int64_t, int64_t>>{
           {FourBitType::kNf4, true, 64, 272}, {FourBitType::kFp4, false, 128, 272}, {FourBitType::kNf4, false, 64, 256},
           {FourBitType::kNf4, true, 64, 256}, {FourBitType::kNf4, true, 64, 288}, {FourBitType::kNf4, true, 64, 264}}) {
    const auto weight = (torch::randn({96, columns}) * torch::logspace(-3, 1, 96).unsqueeze(1)).to(torch::kCUDA);
    auto quantized = quantize_4bit(weight, type, blocksize, double_quant);
    const auto scales = quantize_rows_float8(dequantize_4bit(quantized.packed, quantized.state, torch::kBFloat16)).scales;
    const auto kernel = dequantize_4bit_to_float8(quantized.packed, quantized.state, scales);
    const auto reference = (dequantize_4bit(quantized.packed, quantized.state, torch::kBFloat16).to(torch::kFloat) / scales)
                               .clamp(-448.0, 448.0)
                               .to(torch::kFloat8_e4m3fn);
    EXPECT_EQ((kernel.view(torch::kUInt8) != reference.view(torch::kUInt8)).sum().item<int64_t>(), 0)
        << four_bit_type_name(type) << (double_quant ? ", double quant" : "");
    // The same bytes from a packed buffer one byte off word alignment.
    auto shifted = torch::empty({quantized.packed.numel() + 1}, quantized.packed.options());
    shifted.narrow(0, 1, quantized.packed.numel()).copy_(quantized.packed.view({-1}));
    const auto unaligned =
        dequantize_4bit_to_float8(shifted.narrow(0, 1, quantized.packed.numel()).view(quantized.packed.sizes()),
                                  quantized.state, scales);
    EXPECT_TRUE(torch::equal(unaligned.view(torch::kUInt8), kernel.view(torch::kUInt8)));
  }
}

}  // namespace
}  // namespace qtrain::qat
