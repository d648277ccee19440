// The raw CUDA entry points of kernels/blockwise_quantize.h on small hand-made cases whose results
// are worked out here: a toy quantizer's ranks and codes, the nibble order and padding, a
// double-quantized absmax rebuilt from exactly representable parts, a uniform 8-bit map. Values
// stay far from every pivot, so the approximate reciprocal cannot move them. (The bnb formats and
// fixtures are tested through qat/ in tests/qat and tests/trainer.) GPU tests skip without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/blockwise_quantize.h"
#include "kernels/error.h"

namespace qtrain::kernels {
namespace {

#define SKIP_WITHOUT_CUDA()                                                               \
  if (!kCudaKernelsBuilt) GTEST_SKIP() << "built without the CUDA kernels (no nvcc)";      \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine"

const torch::Device kCuda(torch::kCUDA, 0);

// 11 values in blocks of 8: block 0 has absmax 2, block 1 (partial: 3 values and, the count being
// odd, one padding zero) absmax 0.3. Normalized: {1, -1, 0.2, -0.2, 0.8, -0.6, 0, 0.45} and
// {1, -1/3, 2/3}.
torch::Tensor toy_input() {
  return torch::tensor({2.0f, -2.0f, 0.4f, -0.4f, 1.6f, -1.2f, 0.0f, 0.9f, 0.3f, -0.1f, 0.2f});
}

std::vector<int> bytes_of(const torch::Tensor& packed) {
  const auto values = packed.cpu().to(torch::kInt);
  return std::vector<int>(values.data_ptr<int>(), values.data_ptr<int>() + values.numel());
}

TEST(BlockwiseQuantizeKernels, FourBitCodesAreRanksAmongThresholdsHighNibbleFirst) {
  SKIP_WITHOUT_CUDA();
  const std::vector<float> thresholds = {-0.5f, 0.0f, 0.5f};
  const std::vector<uint8_t> code_of_rank = {0, 1, 2, 3};
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto input = toy_input().to(kCuda, dtype);
    const auto result = quantize_4bit_cuda(input, {thresholds, code_of_rank, false}, 8);
    // Ranks {3,0, 2,1, 3,0, 1,2} and {3,1, 3, padding 0 -> 1}.
    EXPECT_EQ(bytes_of(result.codes), (std::vector<int>{0x30, 0x21, 0x30, 0x12, 0x31, 0x31}));
    ASSERT_EQ(result.absmax.numel(), 2);
    EXPECT_TRUE(result.absmax.is_cuda());
    EXPECT_EQ(result.absmax[0].item<float>(), 2.0f);
    EXPECT_EQ(result.absmax[1].item<float>(), toy_input().to(dtype).to(torch::kFloat32)[8].item<float>());
  }
}

// Sign-magnitude (FP4-like): the rank of |x| among {0.25, 0.75}, plus 8 for x < 0 (not for 0).
TEST(BlockwiseQuantizeKernels, SignMagnitudeCodesAddEightForNegativeValues) {
  SKIP_WITHOUT_CUDA();
  const std::vector<float> thresholds = {0.25f, 0.75f};
  const std::vector<uint8_t> code_of_rank = {0, 1, 2};
  const auto result = quantize_4bit_cuda(toy_input().to(kCuda), {thresholds, code_of_rank, true}, 8);
  // Codes {2,10, 0,8, 2,9, 0,1} and {2,9, 1, padding 0}.
  EXPECT_EQ(bytes_of(result.codes), (std::vector<int>{0x2A, 0x08, 0x29, 0x01, 0x29, 0x10}));
}

// 19 values in blocks of 8: two full groups of 8 (the vector path) and a partial one.
TEST(BlockwiseQuantizeKernels, DequantizeRebuildsADoubleQuantizedAbsmax) {
  SKIP_WITHOUT_CUDA();
  std::vector<float> decode(16);
  for (int code = 0; code < 16; ++code) decode[code] = static_cast<float>(code - 8) * 0.125f;
  std::vector<uint8_t> bytes(10);
  for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<uint8_t>(k * 37 + 11);
  const auto packed = torch::tensor(std::vector<int64_t>(bytes.begin(), bytes.end())).to(torch::kUInt8);
  // absmax[b] = nested_code[q_b] * nested_absmax[b] + offset, nested blocks of 1:
  // 0.25 * 2 + 1 = 1.5, 0.75 * 4 + 1 = 4, -0.5 * 1 + 1 = 0.5.
  auto nested_code = torch::arange(256, torch::kFloat32) * 0.25 - 0.5;
  FourBitScales nested;
  nested.absmax = torch::tensor({3, 5, 0}).to(kCuda, torch::kUInt8);
  nested.nested_absmax = torch::tensor({2.0f, 4.0f, 1.0f}).to(kCuda);
  nested.nested_code = nested_code.to(kCuda);
  nested.offset = 1.0f;
  nested.nested_blocksize = 1;
  FourBitScales plain;
  plain.absmax = torch::tensor({1.5f, 4.0f, 0.5f}).to(kCuda);
  const std::vector<float> absmax = {1.5f, 4.0f, 0.5f};
  std::vector<float> expected;
  for (int64_t i = 0; i < 19; ++i) {
    const int code = i % 2 == 0 ? bytes[i / 2] >> 4 : bytes[i / 2] & 15;
    expected.push_back(decode[code] * absmax[i / 8]);
  }
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    for (const auto* scales : {&plain, &nested}) {
      const auto values = dequantize_4bit_cuda(packed.to(kCuda), 19, 8, decode, *scales, dtype);
      EXPECT_EQ(values.scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(values.cpu(), torch::tensor(expected).to(dtype)));
    }
  }
}

// A uniform map code[i] = (i - 128) / 128: the nearest code of x is 128 + round(128 x).
TEST(BlockwiseQuantizeKernels, EightBitPicksTheNearestCodeOfTheMap) {
  SKIP_WITHOUT_CUDA();
  const auto code = ((torch::arange(256, torch::kFloat32) - 128) / 128).to(kCuda);
  const auto input = torch::tensor({1.0f, 0.3f, -0.7f, 0.05f, -1.0f, 0.5f, -0.25f}).to(kCuda);
  const auto result = quantize_blockwise_8bit_cuda(input, code, 5);
  EXPECT_EQ(bytes_of(result.codes), (std::vector<int>{255, 166, 38, 134, 0, 255, 64}));
  EXPECT_TRUE(torch::equal(result.absmax.cpu(), torch::tensor({1.0f, 0.5f})));
}

// Argument checks come before any CUDA call, so these run on any machine.
TEST(BlockwiseQuantizeKernels, HostTensorsAreAnErrorNamingTheArgument) {
  const std::vector<float> thresholds = {0.0f};
  const std::vector<uint8_t> code_of_rank = {0, 1};
  const auto expect_error_naming = [](const std::function<void()>& call, const std::string& name) {
    try {
      call();
      FAIL() << name << ": a CPU tensor was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(name), std::string::npos) << error.what();
    }
  };
  expect_error_naming([&] { quantize_4bit_cuda(torch::randn({64}), {thresholds, code_of_rank, false}, 64); },
                      "quantize_4bit_cuda");
  expect_error_naming([&] { quantize_blockwise_8bit_cuda(torch::randn({64}), torch::zeros({256}), 64); },
                      "quantize_blockwise_8bit_cuda");
  FourBitScales scales;
  scales.absmax = torch::ones({1});
  expect_error_naming(
      [&] { dequantize_4bit_cuda(torch::zeros({32}, torch::kUInt8), 64, 64, std::vector<float>(16), scales, torch::kFloat32); },
      "dequantize_4bit_cuda");
}

}  // namespace
}  // namespace qtrain::kernels
