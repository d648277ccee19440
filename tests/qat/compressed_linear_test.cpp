// The frozen base kept in a compressed-tensors checkpoint's stored form (qat/compressed_linear.h):
// each format's dequantization against the formula computed element by element in float64 from
// the stored tensors, the layer's forward and gradients, and on CUDA the same bits as on the CPU.
// (Bit-exactness with the compressed-tensors package: tests/trainer/compressed_tensors_test.cpp.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "qat/compressed_linear.h"
#include "qat/compressed_weight.h"
#include "qat/lora_linear.h"

namespace qtrain::qat {
namespace {

// A [96, 256] weight with outliers, an all-zero group and a negative-only row.
torch::Tensor test_weight(torch::ScalarType dtype) {
  torch::manual_seed(7);
  auto weight = torch::randn({96, 256}, torch::kFloat32) * 0.05;
  weight.index_put_({3, 17}, 1.5);
  weight.index_put_({5, torch::indexing::Slice(128, 256)}, 0.0);
  weight.index_put_({9}, -weight.index({9}).abs());
  return weight.to(dtype);
}

// (q - z) * s or q * s from the stored form, element by element in float64: the layout of
// compressed_weight.h read independently of CompressedWeight::codes.
torch::Tensor reference_values(const CompressedWeight& weight) {
  const int64_t out = weight.out_features;
  const int64_t in = weight.in_features;
  auto result = torch::empty({out, in}, torch::kFloat64);
  const auto scales = weight.scale.to(torch::kFloat64);
  const int64_t groups = scales.size(-1);
  const int64_t group = in / groups;
  const auto data = weight.data.contiguous();
  for (int64_t row = 0; row < out; ++row) {
    for (int64_t column = 0; column < in; ++column) {
      double value = 0;
      if (weight.format == CompressionFormat::kPackQuantized) {
        const int64_t bits = weight.spec.bits;
        const int64_t bit = column * bits;
        const uint64_t low = static_cast<uint32_t>(data[row][bit / 32].item<int32_t>());
        const uint64_t high = bit / 32 + 1 < data.size(1) ? static_cast<uint32_t>(data[row][bit / 32 + 1].item<int32_t>()) : 0;
        const auto code = static_cast<int64_t>(((low | (high << 32)) >> (bit % 32)) & ((1u << bits) - 1)) - (int64_t{1} << (bits - 1));
        double zero = 0;
        if (weight.zero_point.defined()) {
          const int64_t zbit = row * bits;
          const auto word = static_cast<uint32_t>(weight.zero_point[zbit / 32][column / group].item<int32_t>());
          zero = static_cast<double>(static_cast<int64_t>((word >> (zbit % 32)) & ((1u << bits) - 1)) - (int64_t{1} << (bits - 1)));
        }
        value = (static_cast<double>(code) - zero) * scales[row][column / group].item<double>();
      } else if (weight.format == CompressionFormat::kIntQuantized) {
        value = static_cast<double>(data[row][column].item<int8_t>()) * scales[row][column / group].item<double>();
      } else if (weight.format == CompressionFormat::kFloatQuantized) {
        value = data[row][column].to(torch::kFloat64).item<double>() * scales[row][column / group].item<double>();
      } else {
        static const double kE2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
        const int byte = data[row][column / 2].item<uint8_t>();
        const int nibble = column % 2 == 0 ? byte & 0xF : byte >> 4;
        const double magnitude = kE2m1[nibble & 7] * (nibble & 8 ? -1.0 : 1.0);
        const double group_scale =
            static_cast<double>(static_cast<float>(scales[row][column / group].item<double>() / weight.global_scale.item<double>()));
        value = static_cast<double>(static_cast<float>(magnitude * group_scale));
      }
      result[row][column] = value;
    }
  }
  return result;
}

TEST(CompressedWeight, EveryPresetDequantizesToItsStoredCodesTimesScales) {
  for (const auto& preset : quant_presets()) {
    const auto weight = compress_weight(preset, test_weight(torch::kFloat32));
    const auto expected = reference_values(weight);
    // fp32 arithmetic (NVFP4: rounded to bf16) against float64: equal up to one product's rounding.
    const auto got = weight.dequantize(torch::kFloat32).to(torch::kFloat64);
    const auto tolerance = preset.two_level_scales ? 4e-3 : 1e-6;
    EXPECT_LE(((got - expected).abs() / expected.abs().clamp_min(1e-6)).max().item<double>(), tolerance) << preset.name;
    // Round to nearest: every value within half a step of the weight, clipping aside.
    const auto error = (got - test_weight(torch::kFloat32).to(torch::kFloat64)).abs().max().item<double>();
    EXPECT_LT(error, preset.weights.bits == 4 ? 0.25 : 0.02) << preset.name;
  }
}

TEST(CompressedLinear, ForwardMultipliesByTheDequantizedWeightAndGradientsReachTheInput) {
  const auto& preset = find_quant_preset("W4A16_ASYM", "test");
  auto bias = torch::randn({96});
  CompressedLinear layer(compress_weight(preset, test_weight(torch::kFloat32)), bias, torch::kFloat32);
  EXPECT_EQ(layer.in_features(), 256);
  EXPECT_EQ(layer.out_features(), 96);
  auto input = torch::randn({2, 5, 256}, torch::requires_grad());
  const auto output = layer.forward(input);
  const auto dense = layer.dense_weight(torch::kFloat32);
  EXPECT_TRUE(torch::allclose(output, torch::nn::functional::linear(input, dense, bias), 1e-5, 1e-5));
  output.sum().backward();
  EXPECT_TRUE(torch::allclose(input.grad(), dense.sum(0).expand({2, 5, 256}), 1e-5, 1e-5));
  // Frozen: no parameters, only the stored buffers, under the checkpoint's names.
  EXPECT_TRUE(layer.parameters().empty());
  for (const char* name : {"weight_packed", "weight_scale", "weight_zero_point", "bias"}) {
    EXPECT_NE(layer.named_buffers().find(name), nullptr) << name;
  }
}

// On the GPU the stored tensors stay stored and dequantize to the CPU's bits, in bf16 and fp32.
TEST(CompressedLinear, CudaDequantizesToTheCpusBits) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  for (const auto& preset : quant_presets()) {
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      const auto weight = compress_weight(preset, test_weight(dtype));
      const auto cpu = weight.dequantize(dtype);
      const auto cuda = weight.to(torch::Device(torch::kCUDA, 0)).dequantize(dtype);
      EXPECT_TRUE(torch::equal(cpu, cuda.cpu())) << preset.name << " " << c10::toString(dtype);
      CompressedLinear layer(weight, torch::Tensor(), dtype);
      layer.to(torch::Device(torch::kCUDA, 0));
      EXPECT_TRUE(layer.compressed_weight().data.is_cuda());
      EXPECT_EQ(layer.compressed_weight().data.scalar_type(), weight.data.scalar_type()) << preset.name;
      const auto input = torch::randn({4, 256}, torch::TensorOptions(dtype).device(torch::kCUDA));
      const auto expected = torch::nn::functional::linear(input, cuda);
      EXPECT_TRUE(torch::equal(layer.forward(input), expected)) << preset.name;
    }
  }
}

}  // namespace
}  // namespace qtrain::qat
