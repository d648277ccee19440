// The FP8 base (qat/float8_linear.h) on fresh random inputs: the row quantizer against the e4m3
// grid in float64, the matmuls against float64 products of the quantized operands and of the
// unquantized ones, the layer standalone and under a LoRA adapter. On a GPU with FP8 tensor cores
// (skipped elsewhere): the CUDA quantizer byte for byte against the torch operations, and
// _scaled_mm against the reference path.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>

#include "kernels/error.h"
#include "kernels/float8_gemm.h"
#include "kernels/float8_rows.h"
#include "qat/float8_codec.h"
#include "qat/float8_linear.h"
#include "qat/float8_matmul.h"
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

TEST(Float8Linear, ForwardAndBackwardStandaloneWithBiasAndNoParameters) {
  torch::manual_seed(7);
  Float8Options options;
  options.compute_dtype = torch::kFloat;
  auto layer = Float8Linear::from_dense(torch::randn({32, 64}) * 0.1, torch::randn({32}), options);
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
  LoraOptions options;
  options.rank = 4;
  options.alpha = 8;
  options.dropout = dropout;
  auto lora = std::make_shared<LoraLinear>(base, options);
  torch::NoGradGuard no_grad;
  lora->lora_B().normal_(0.0, 0.1);
  return lora;
}

// Under LoRA the base's share comes from its own products; the adapter's gradients are those of
// the same adapter over any base.
TEST(Float8Linear, LoraOverAnFp8BaseAddsTheBaseProductsToTheAdapters) {
  torch::manual_seed(8);
  const auto weight = torch::randn({32, 64}) * 0.1;
  Float8Options options;
  options.compute_dtype = torch::kFloat;
  auto base = Float8Linear::from_dense(weight, torch::Tensor(), options);
  auto lora = adapter_over(base, 0.0);

  auto input = torch::randn({6, 64}, torch::requires_grad());
  const auto output = lora->forward(input);
  const auto grad = torch::randn({6, 32});
  output.backward(grad);

  const auto x = as_double(input.detach()), a = as_double(lora->lora_A()), b = as_double(lora->lora_B()), g = as_double(grad);
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
  Float8Options options;
  options.compute_dtype = torch::kFloat;
  torch::manual_seed(11);
  auto base = Float8Linear::from_dense(torch::randn({32, 64}) * 0.1, torch::Tensor(), options);
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

}  // namespace
}  // namespace qtrain::qat
