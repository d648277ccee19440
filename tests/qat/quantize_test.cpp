// The quantizers of qat/quantize.h against references we did not compute with them: float64
// loops of torchao's integer formulas, torch's own float8 casts, the OCP E2M1 grid written out,
// and the bitsandbytes-exact 4-bit codec for NF4 / FP4.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "kernels/cuda_build.h"
#include "kernels/error.h"
#include "qat/four_bit_codec.h"
#include "qat/quantize.h"
#include "quant_reference.h"

namespace qtrain::qat {
namespace {

using reference::int_spec;

QuantSpec float_spec(QuantFormat format, Granularity granularity, int64_t group_size = 32) {
  QuantSpec spec;
  spec.format = format;
  spec.bits = quant_format_info(format).bits;
  spec.granularity = granularity;
  spec.group_size = group_size;
  return spec;
}

// Weights with a heavy tail and an asymmetric shift, so that min and max differ per block.
torch::Tensor random_weights(std::vector<int64_t> shape, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randn(shape) * 0.05 + torch::rand(shape).pow(6) * 0.2 - 0.01;
}

std::string expect_error(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected an Error";
  return "";
}

// Every int quantizer (bits, mapping, granularity): scale within one fp32 rounding of the
// float64 reference, codes equal to it (within one step where x / s is within 1e-4 of a rounding
// tie, which fp32 and float64 may break apart; nearly all equal), and dequantized values within
// one fp32 rounding of (q - z) * s.
TEST(Quantize, IntQuantizersMatchFloat64Reference) {
  const std::vector<Granularity> granularities = {Granularity::kPerTensor, Granularity::kPerChannel,
                                                  Granularity::kPerToken, Granularity::kPerGroup};
  uint64_t seed = 10;
  for (int64_t bits = 2; bits <= 8; ++bits) {
    for (const bool symmetric : {true, false}) {
      for (const auto granularity : granularities) {
        const auto spec = int_spec(bits, symmetric, granularity, 32);
        SCOPED_TRACE(spec.describe());
        const auto x = random_weights({6, 4, 64}, ++seed);
        const auto params = choose_qparams(spec, block_min_max(spec, x));
        const auto codes = quantize(spec, x, params);
        const auto values = dequantize(spec, codes, params);
        ASSERT_EQ(codes.scalar_type(), torch::kInt8);
        ASSERT_EQ(params.scale.sizes(), c10::IntArrayRef(params_shape(spec, x.sizes())));

        const auto blocks = reference::blocks_of(spec, x);
        const auto scales_tensor = params.scale.to(torch::kFloat64).contiguous();
        const auto zero_points_tensor = params.zero_point.to(torch::kFloat64).contiguous();
        const auto codes_tensor = codes.to(torch::kFloat64).contiguous();
        const auto values_tensor = values.to(torch::kFloat64).contiguous();
        const double* scales = scales_tensor.data_ptr<double>();
        const double* zero_points = zero_points_tensor.data_ptr<double>();
        const double* code_values = codes_tensor.data_ptr<double>();
        const double* dequantized = values_tensor.data_ptr<double>();
        int64_t compared = 0, index = 0;
        for (size_t block = 0; block < blocks.size(); ++block) {
          const auto expected = reference::int_params(spec, blocks[block]);
          const double scale = scales[block];
          ASSERT_NEAR(scale, expected.scale, expected.scale * 1.2e-7) << "block " << block;
          ASSERT_EQ(zero_points[block], expected.zero_point) << "block " << block;
          for (const double element : blocks[block]) {
            const auto code = reference::int_code(spec, element, {scale, expected.zero_point});
            const double ours = code_values[index];
            if (code.near_tie) {
              ASSERT_LE(std::abs(ours - code.q), 1.0) << "element " << index << " = " << element;
            } else {
              ASSERT_EQ(ours, code.q) << "element " << index << " = " << element;
            }
            compared += ours == code.q;
            const double expected_value = (ours - expected.zero_point) * scale;
            ASSERT_NEAR(dequantized[index], expected_value, std::abs(expected_value) * 6e-8 + 1e-30);
            ++index;
          }
        }
        EXPECT_GT(compared, x.numel() * 99 / 100);
      }
    }
  }
}

TEST(Quantize, SymmetricInt4UsesTorchaoRangeAndScale) {
  // absmax 1.5 -> s = 1.5 / 7.5 = 0.2; -1.5 -> -8, +1.5 -> 7.5 rounds to 8, clipped to 7.
  const auto spec = int_spec(4, true, Granularity::kPerTensor);
  const auto x = torch::tensor({-1.5f, 1.5f, 0.0f, 0.3f, 0.5f});
  const auto params = choose_qparams(spec, block_min_max(spec, x));
  EXPECT_FLOAT_EQ(params.scale.item<float>(), 0.2f);
  const auto codes = quantize(spec, x, params);
  // 0.3 / 0.2 = 1.5 -> 2 (even), 0.5 / 0.2 = 2.5 -> 2 (even), in fp32 as torch rounds.
  const auto expected = torch::round(torch::tensor({-1.5f, 1.5f, 0.0f, 0.3f, 0.5f}) / 0.2f).clamp(-8, 7).to(torch::kInt8);
  EXPECT_TRUE(torch::equal(codes, expected)) << codes;
  EXPECT_EQ(codes[0].item<int>(), -8);
  EXPECT_EQ(codes[1].item<int>(), 7);
}

TEST(Quantize, AllZeroBlockQuantizesToZeros) {
  const auto spec = int_spec(4, false, Granularity::kPerGroup);
  const auto x = torch::zeros({2, 64});
  const auto params = choose_qparams(spec, block_min_max(spec, x));
  EXPECT_TRUE(torch::all(params.scale > 0).item<bool>());
  EXPECT_TRUE(torch::equal(fake_quantize_values(spec, x, params).values, x));
}

TEST(Quantize, Fp16ScaleIsTheFp16RoundedScale) {
  auto spec = QuantSpec::gguf_q4_0();
  const auto x = random_weights({8, 64}, 3);
  const auto params = choose_qparams(spec, block_min_max(spec, x));
  auto fp32_spec = spec;
  fp32_spec.scale_dtype = torch::kFloat32;
  const auto fp32_params = choose_qparams(fp32_spec, block_min_max(fp32_spec, x));
  EXPECT_TRUE(torch::equal(params.scale, fp32_params.scale.to(torch::kFloat16).to(torch::kFloat32)));
  EXPECT_FALSE(torch::equal(params.scale, fp32_params.scale));  // the rounding did something
}

TEST(Quantize, MinifloatGridsEqualTorchFloat8Values) {
  const auto codes = torch::arange(256, torch::kInt64).to(torch::kUInt8);
  for (const auto& [format, dtype] : {std::pair{QuantFormat::kFp8E4m3, torch::kFloat8_e4m3fn},
                                      std::pair{QuantFormat::kFp8E5m2, torch::kFloat8_e5m2}}) {
    const auto torch_values = codes.view(dtype).to(torch::kFloat32);
    const auto ours = float_grid_values(format);
    const auto finite = torch::isfinite(torch_values);
    EXPECT_TRUE(torch::equal(ours.masked_select(finite), torch_values.masked_select(finite))) << quant_format_name(format);
    EXPECT_TRUE(torch::isnan(ours.masked_select(finite.logical_not())).all().item<bool>());
  }
}

// Codes are the float8 bit patterns torch's own casts (round to nearest even) produce, and the
// values the cast values times the scale, for every granularity.
TEST(Quantize, Fp8QuantizersEqualTorchCasts) {
  for (const auto& [format, dtype] : {std::pair{QuantFormat::kFp8E4m3, torch::kFloat8_e4m3fn},
                                      std::pair{QuantFormat::kFp8E5m2, torch::kFloat8_e5m2}}) {
    for (const auto granularity : {Granularity::kPerTensor, Granularity::kPerChannel, Granularity::kPerGroup}) {
      const auto spec = float_spec(format, granularity);
      SCOPED_TRACE(spec.describe());
      const auto x = random_weights({16, 128}, 40 + static_cast<int>(granularity));
      const auto params = choose_qparams(spec, block_min_max(spec, x));
      const auto blocks_shape = block_view_shape(spec, x.sizes());
      const auto scaled = (x.reshape(blocks_shape) / params.scale.unsqueeze(-1)).reshape(x.sizes());
      const double max_value = quant_format_info(format).max_value;
      const auto cast = scaled.clamp(-max_value, max_value).to(dtype);
      EXPECT_TRUE(torch::equal(quantize(spec, x, params), cast.view(torch::kUInt8)));
      const auto expected = (cast.to(torch::kFloat32).reshape(blocks_shape) * params.scale.unsqueeze(-1)).reshape(x.sizes());
      EXPECT_TRUE(torch::equal(fake_quantize_values(spec, x, params).values, expected));
      // And near its float64 value: half a step of a 3-bit (2-bit) mantissa, relative.
      const double relative_step = format == QuantFormat::kFp8E4m3 ? 1.0 / 16 : 1.0 / 8;
      const auto error = (fake_quantize_values(spec, x, params).values.to(torch::kFloat64) - x.to(torch::kFloat64)).abs();
      const auto scale_per_element =
          params.scale.unsqueeze(-1).expand(blocks_shape).reshape(x.sizes()).to(torch::kFloat64);
      const auto subnormal_step = scale_per_element * std::ldexp(1.0, 1 - quant_format_info(format).exponent_bias -
                                                                          quant_format_info(format).mantissa_bits);
      EXPECT_TRUE((error <= x.to(torch::kFloat64).abs() * relative_step + subnormal_step / 2).all().item<bool>());
    }
  }
}

TEST(Quantize, Fp4E2m1RoundsToNearestEvenOnItsGrid) {
  // The OCP E2M1 magnitudes; index parity is the mantissa bit, so a tie goes to the even index.
  const std::vector<double> grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const auto spec = float_spec(QuantFormat::kFp4E2m1, Granularity::kPerTensor);
  torch::manual_seed(7);
  auto scaled = torch::cat({torch::rand({4000}) * 14 - 7, torch::tensor({0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -5.0f, -0.25f})});
  const QuantParams unit{torch::ones({1}), torch::zeros({1})};
  const auto values = fake_quantize_values(spec, scaled, unit).values.to(torch::kFloat64);
  for (int64_t index = 0; index < scaled.numel(); ++index) {
    const double x = scaled[index].item<double>();
    const double magnitude = std::min(std::abs(x), 6.0);
    size_t best = 0;
    for (size_t candidate = 1; candidate < grid.size(); ++candidate) {
      const double distance = std::abs(grid[candidate] - magnitude), best_distance = std::abs(grid[best] - magnitude);
      if (distance < best_distance || (distance == best_distance && candidate % 2 == 0)) best = candidate;
    }
    ASSERT_EQ(std::abs(values[index].item<double>()), grid[best]) << "x = " << x;
  }
  EXPECT_EQ(float_grid_values(QuantFormat::kFp4E2m1).slice(0, 0, 8).to(torch::kFloat64).equal(torch::tensor(grid, torch::kFloat64)), true);
}

// NF4 / FP4 per group = bitsandbytes' blockwise 4-bit quantization with that blocksize.
TEST(Quantize, Nf4AndFp4EqualTheBitsandbytesCodec) {
  const auto x = random_weights({32, 256}, 5);
  for (const auto format : {QuantFormat::kNf4, QuantFormat::kFp4}) {
    const auto spec = float_spec(format, Granularity::kPerGroup, 64);
    const auto params = choose_qparams(spec, block_min_max(spec, x));
    const auto four_bit_type = quant_format_info(format).four_bit_type;
    const auto bnb = quantize_4bit(x, four_bit_type, 64, /*double_quant=*/false);
    EXPECT_TRUE(torch::equal(fake_quantize_values(spec, x, params).values,
                             dequantize_4bit(bnb.packed, bnb.state, torch::kFloat32)))
        << quant_format_name(format);
  }
}

TEST(Quantize, CodesDequantizeToTheFakeQuantValuesForEveryFormat) {
  const auto x = random_weights({8, 128}, 9);
  for (const auto format : {QuantFormat::kInt, QuantFormat::kFp8E4m3, QuantFormat::kFp8E5m2, QuantFormat::kFp4E2m1,
                            QuantFormat::kNf4, QuantFormat::kFp4}) {
    const auto spec = format == QuantFormat::kInt ? int_spec(3, false, Granularity::kPerGroup)
                                                  : float_spec(format, Granularity::kPerGroup);
    const auto tensor = quantize_tensor(spec, x, choose_qparams(spec, block_min_max(spec, x)));
    EXPECT_TRUE(torch::equal(tensor.dequantize(), fake_quantize_values(spec, x, tensor.params).values))
        << quant_format_name(format);
  }
  const auto float_zero_point = QuantSpec::int4_weight_only(32);
  const auto tensor = quantize_tensor(float_zero_point, x, choose_qparams(float_zero_point, block_min_max(float_zero_point, x)));
  EXPECT_TRUE(torch::equal(tensor.dequantize(), fake_quantize_values(float_zero_point, x, tensor.params).values));
}

// On CUDA, int grids take the one-pass kernel (kernels/fake_quantize.h): its values and mask are
// the torch operations' bits, for every width, mapping and granularity, with data-driven
// parameters and with a fixed scale that puts values on rounding ties, beyond the grid, at
// infinity and at NaN.
TEST(Quantize, CudaIntFakeQuantizationEqualsTheTorchOperationsBitForBit) {
  if (!kernels::kCudaKernelsBuilt || !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto cuda = torch::Device(torch::kCUDA);
  const auto x = random_weights({96, 256}, 13).to(cuda);
  auto edges = torch::arange(-40, 40, torch::kFloat32).to(cuda) * 0.5f * 0.01f;  // k/2 steps of 0.01
  edges = torch::cat({edges, torch::tensor({INFINITY, -INFINITY, NAN, 1e30f, -0.0f, 0.0f}, cuda)});
  edges = torch::cat({edges, torch::zeros({96 - edges.numel() % 96}, cuda)}).view({96, -1});
  for (const int64_t bits : {2, 4, 8}) {
    for (const bool symmetric : {true, false}) {
      for (const auto granularity : {Granularity::kPerGroup, Granularity::kPerChannel, Granularity::kPerTensor}) {
        const auto spec = int_spec(bits, symmetric, granularity);
        const std::string name = spec.describe();
        const auto params = choose_qparams(spec, block_min_max(spec, x));
        const auto fused = fake_quantize_values(spec, x, params);
        const auto reference = fake_quantize_values_reference(spec, x, params);
        EXPECT_TRUE(torch::equal(fused.values, reference.values)) << name;
        EXPECT_TRUE(torch::equal(fused.inside, reference.inside)) << name;
        if (granularity != Granularity::kPerChannel) continue;
        const QuantParams fixed{torch::full({96, 1}, 0.01f, cuda), torch::full({96, 1}, symmetric ? 0.0f : 1.0f, cuda)};
        const auto fused_edges = fake_quantize_values(spec, edges, fixed);
        const auto reference_edges = fake_quantize_values_reference(spec, edges, fixed);
        EXPECT_TRUE(torch::equal(fused_edges.values, reference_edges.values)) << name << " at the edges";
        EXPECT_TRUE(torch::equal(fused_edges.inside, reference_edges.inside)) << name << " at the edges";
      }
    }
  }
}

TEST(QuantSpec, BadSpecsNameTheKeyAndTheReason) {
  auto spec = int_spec(9, true, Granularity::kPerGroup);
  EXPECT_EQ(expect_error([&] { spec.validate("qat.weights"); }),
            "qat.weights.bits: 9 is out of range (int formats take 2 to 8 bits)");
  spec.bits = 1;
  EXPECT_NE(expect_error([&] { spec.validate("qat.weights"); }).find("qat.weights.bits: 1 is out of range"), std::string::npos);
  spec = int_spec(4, true, Granularity::kPerGroup, 48);
  EXPECT_EQ(expect_error([&] { spec.validate_for_shape("qat.weights", {128, 64}); }),
            "qat.weights.group_size: 48 does not divide the last dimension 64 of a tensor of shape [128, 64]");
  spec.group_size = 0;
  EXPECT_NE(expect_error([&] { spec.validate("qat.weights"); }).find("qat.weights.group_size: 0 must be positive"),
            std::string::npos);
  auto fp8 = float_spec(QuantFormat::kFp8E4m3, Granularity::kPerChannel);
  fp8.symmetric = false;
  EXPECT_NE(expect_error([&] { fp8.validate("qat.activations"); }).find("qat.activations.symmetric: false"),
            std::string::npos);
  fp8 = float_spec(QuantFormat::kFp8E4m3, Granularity::kPerChannel);
  fp8.bits = 4;
  EXPECT_NE(expect_error([&] { fp8.validate("qat.weights"); }).find("does not fit format fp8_e4m3, which has 8 bits"),
            std::string::npos);
  EXPECT_EQ(expect_error([] { parse_quant_format("int3", "qat.weights.format"); }),
            "qat.weights.format: unknown quant format 'int3' (expected one of int, fp8_e4m3, fp8_e5m2, fp4_e2m1, nf4, fp4, gguf)");
  EXPECT_NE(expect_error([] { parse_granularity("per_row", "qat.weights.granularity"); }).find("'per_row'"),
            std::string::npos);
  auto float_zero_point = QuantSpec::int4_weight_only(32);
  float_zero_point.symmetric = true;
  EXPECT_NE(expect_error([&] { float_zero_point.validate("qat.weights"); })
                .find("qat.weights.zero_point_domain: float (torchao's int4 weight-only grid) needs symmetric: false"),
            std::string::npos);
  float_zero_point = QuantSpec::int4_weight_only(32);
  float_zero_point.scale_dtype = torch::kFloat16;
  EXPECT_NE(expect_error([&] { float_zero_point.validate("qat.weights"); }).find("needs scale_dtype fp32"), std::string::npos);
}

TEST(QuantSpec, NamesRoundTrip) {
  for (const auto format : {QuantFormat::kInt, QuantFormat::kFp8E4m3, QuantFormat::kFp8E5m2, QuantFormat::kFp4E2m1,
                            QuantFormat::kNf4, QuantFormat::kFp4}) {
    EXPECT_EQ(parse_quant_format(quant_format_name(format), "k"), format);
  }
  for (const auto granularity : {Granularity::kPerTensor, Granularity::kPerChannel, Granularity::kPerToken, Granularity::kPerGroup}) {
    EXPECT_EQ(parse_granularity(granularity_name(granularity), "k"), granularity);
  }
  EXPECT_EQ(QuantSpec::gguf_q4_0().describe(), "int4 symmetric per_group(32) scale fp16");
  EXPECT_EQ(QuantSpec::int8_dynamic_per_token_activation().describe(), "int8 asymmetric per_token scale fp32");
  for (const auto domain : {ZeroPointDomain::kInt, ZeroPointDomain::kFloat}) {
    EXPECT_EQ(parse_zero_point_domain(zero_point_domain_name(domain), "k"), domain);
  }
  EXPECT_EQ(QuantSpec::int4_weight_only(128).describe(), "int4 asymmetric per_group(128) scale fp32 zero_point float");
}

}  // namespace
}  // namespace qtrain::qat
