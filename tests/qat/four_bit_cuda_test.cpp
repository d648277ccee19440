// The CUDA path of the 4-bit codec (kernels/blockwise_quantize.h, reached through qat::quantize_4bit,
// dequantize_4bit and quantize_blockwise_8bit on CUDA tensors) against the CPU reference path, on
// fresh random inputs: dequantization equal bit for bit in every dtype; quantization equal except
// where bnb's approximate reciprocal of absmax (which the kernels reproduce and the CPU cannot)
// moves a value across a pivot. Bit-exactness with bitsandbytes itself is checked on the fixtures in
// tests/trainer/bnb_checkpoint_test.cpp. Every test here skips without a CUDA GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "qat/four_bit_codec.h"
#include "qat/four_bit_format.h"
#include "qat/four_bit_linear.h"
#include "tensor_support.h"

namespace qtrain::qat {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine"

const torch::Device kCuda(torch::kCUDA, 0);

using testing::same_bits;

torch::Tensor unpack_device_codes(const torch::Tensor& packed, int64_t n) {
  const auto bytes = packed.cpu().reshape({-1}).to(torch::kInt);
  return torch::stack({torch::bitwise_right_shift(bytes, 4), torch::bitwise_and(bytes, 15)}, 1).reshape({-1}).narrow(0, 0, n);
}

FourBitQuantState state_on(const FourBitQuantState& state, const torch::Device& device) {
  FourBitQuantState moved = state;
  for (auto* tensor : {&moved.code, &moved.absmax, &moved.nested_absmax, &moved.nested_code}) {
    if (tensor->defined()) *tensor = tensor->to(device);
  }
  return moved;
}

// Weights as a checkpoint has them: normal with a per-row scale, a heavy tail, a block of zeros at
// the start (absmax 0: every code is that of NaN) and an odd count, so the last block is partial
// and the last byte padded.
torch::Tensor random_weight(int64_t rows, int64_t columns, torch::ScalarType dtype) {
  auto weight = torch::randn({rows, columns}) * torch::rand({rows, 1}) * 0.05;
  weight.view(-1).narrow(0, 4096, 4096).mul_(torch::rand({4096}).pow(4) * 20);
  weight.view(-1).narrow(0, 0, 4096).zero_();
  return weight.to(dtype);
}

constexpr std::array<int64_t, 7> kBlocksizes = {64, 128, 256, 512, 1024, 2048, 4096};

// Codes from the CUDA and the CPU path (same input, same absmax) may differ only where one step of
// the reciprocal moves x * (1 / absmax) across a pivot: the CUDA code is then the one the CPU's
// quantizer gives with 1 / absmax moved one fp32 step up or down.
void expect_codes_differ_only_by_the_reciprocal(const torch::Tensor& cuda_codes, const torch::Tensor& cpu_codes,
                                                const torch::Tensor& input, const torch::Tensor& absmax,
                                                int64_t blocksize, const std::function<int(float)>& quantize) {
  const auto differing = (cuda_codes != cpu_codes).nonzero().view(-1);
  const auto values = input.cpu().to(torch::kFloat32).reshape({-1});
  const auto absmax_cpu = absmax.cpu();
  for (int64_t k = 0; k < differing.numel(); ++k) {
    const int64_t i = differing[k].item<int64_t>();
    const float inverse = 1.0f / absmax_cpu[i / blocksize].item<float>();
    const float x = values[i].item<float>();
    const int cuda_code = cuda_codes[i].item<int>();
    EXPECT_TRUE(quantize(x * std::nextafter(inverse, 0.0f)) == cuda_code ||
                quantize(x * std::nextafter(inverse, 1e30f)) == cuda_code)
        << "element " << i << " (x = " << x << ") differs by more than the reciprocal's rounding";
  }
  // Rare: one in 1,800 at most over the H100 runs (FP4, blocksize 4096, bf16: 11 of 20,313).
  EXPECT_LE(differing.numel(), std::max<int64_t>(2, input.numel() / 1000));
}

TEST(FourBitCuda, DequantizeEqualsTheCpuReferenceBitForBitInEveryDtype) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(21);
  const auto input = random_weight(97, 301, torch::kBFloat16);  // 29197 values
  for (const auto type : {FourBitType::kNf4, FourBitType::kFp4}) {
    for (const int64_t blocksize : kBlocksizes) {
      for (const bool double_quant : {false, true}) {
        const auto quantized = quantize_4bit(input, type, blocksize, double_quant);
        const auto packed_cuda = quantized.packed.to(kCuda);
        const auto state_cuda = state_on(quantized.state, kCuda);
        for (const auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
          SCOPED_TRACE(four_bit_type_name(type) + " blocksize " + std::to_string(blocksize) +
                       (double_quant ? " dq " : " ") + std::string(c10::toString(dtype)));
          const auto expected = dequantize_4bit(quantized.packed, quantized.state, dtype);
          const auto restored = dequantize_4bit(packed_cuda, state_cuda, dtype);
          EXPECT_TRUE(restored.is_cuda());
          EXPECT_TRUE(same_bits(restored, expected))
              << (restored.cpu() != expected).sum().item<int64_t>() << " values differ";
        }
      }
    }
  }
}

// A packed weight that is a view at an odd byte offset takes the kernel's byte-wise loads.
TEST(FourBitCuda, DequantizeReadsAPackedWeightAtAnyOffset) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(22);
  const auto input = torch::randn({8, 64});
  const auto quantized = quantize_4bit(input, FourBitType::kNf4, 64, true);
  const auto shifted = torch::cat({torch::zeros({1, 1}, torch::kUInt8), quantized.packed}).to(kCuda).narrow(0, 1, 256);
  const auto restored = dequantize_4bit(shifted, state_on(quantized.state, kCuda), torch::kFloat32);
  EXPECT_TRUE(same_bits(restored, dequantize_4bit(quantized.packed, quantized.state, torch::kFloat32)));
}

TEST(FourBitCuda, QuantizeEqualsTheCpuReferenceUpToTheApproximateReciprocal) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(23);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
    const auto input = random_weight(61, 333, dtype);  // 20313 values
    const auto input_cuda = input.to(kCuda);
    for (const auto type : {FourBitType::kNf4, FourBitType::kFp4}) {
      const auto& format = four_bit_format(type);
      for (const int64_t blocksize : kBlocksizes) {
        SCOPED_TRACE(format.name + " blocksize " + std::to_string(blocksize) + " " + std::string(c10::toString(dtype)));
        const auto cpu = quantize_4bit(input, type, blocksize, false);
        const auto cuda = quantize_4bit(input_cuda, type, blocksize, false);
        ASSERT_TRUE(cuda.packed.is_cuda() && cuda.state.absmax.is_cuda() && cuda.state.code.is_cuda());
        EXPECT_EQ(cuda.packed.sizes(), cpu.packed.sizes());
        EXPECT_TRUE(same_bits(cuda.state.absmax, cpu.state.absmax));
        EXPECT_TRUE(same_bits(cuda.state.code, cpu.state.code));
        expect_codes_differ_only_by_the_reciprocal(unpack_device_codes(cuda.packed, input.numel()),
                                                   unpack_device_codes(cpu.packed, input.numel()), input,
                                                   cpu.state.absmax, blocksize,
                                                   [&](float x) { return format.quantize(x); });
        // The padding nibble of the odd count, and the block of zeros (codes of NaN).
        EXPECT_EQ(cuda.packed.cpu()[-1][0].item<int>() & 15, cpu.packed[-1][0].item<int>() & 15);
        EXPECT_EQ(cuda.packed.cpu()[0][0].item<int>(), cpu.packed[0][0].item<int>());
      }
    }
  }
}

// Double quantization on CUDA: the offset is torch's CUDA mean (the CPU path sums in float64, so
// the two may differ in the last bit), the nested absmax is 8-bit blockwise quantized on the GPU.
TEST(FourBitCuda, DoubleQuantizationStaysOnTheDeviceAndRebuildsTheAbsmax) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(24);
  const auto input = random_weight(300, 640, torch::kBFloat16);  // 3000 blocks of 64: 12 nested blocks
  const auto input_cuda = input.to(kCuda);
  const auto plain = quantize_4bit(input_cuda, FourBitType::kNf4, 64, false);
  const auto nested = quantize_4bit(input_cuda, FourBitType::kNf4, 64, true);
  ASSERT_TRUE(nested.state.double_quant());
  for (const auto& tensor : {nested.state.absmax, nested.state.nested_absmax, nested.state.nested_code}) {
    EXPECT_TRUE(tensor.is_cuda());
  }
  EXPECT_TRUE(same_bits(nested.packed, plain.packed));
  EXPECT_EQ(nested.state.absmax.scalar_type(), torch::kUInt8);
  EXPECT_EQ(nested.state.nested_absmax.numel(), 12);
  EXPECT_NEAR(nested.state.offset, quantize_4bit(input, FourBitType::kNf4, 64, true).state.offset, 1e-7);
  const auto rebuilt = dequantize_absmax(nested.state);
  EXPECT_LT((rebuilt - plain.state.absmax).abs().max().item<float>(),
            nested.state.nested_absmax.max().item<float>() / 32);
}

TEST(FourBitCuda, BlockwiseEightBitEqualsTheCpuReferenceUpToTheApproximateReciprocal) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(25);
  const auto map = signed_dynamic_map();
  const auto input = torch::randn({5000}) * torch::rand({5000}).pow(3);
  for (const int64_t blocksize : {64, 256, 2048, 4096}) {
    SCOPED_TRACE("blocksize " + std::to_string(blocksize));
    const auto cpu = quantize_blockwise_8bit(input, map, blocksize);
    const auto cuda = quantize_blockwise_8bit(input.to(kCuda), map, blocksize);
    ASSERT_TRUE(cuda.codes.is_cuda() && cuda.absmax.is_cuda());
    EXPECT_EQ(cuda.codes.sizes(), input.sizes());
    EXPECT_TRUE(same_bits(cuda.absmax, cpu.absmax));
    // The CPU path's code for a normalized value v: v in a block whose absmax is 1 (beyond +-1,
    // where only the absmax's own element lands, the code is that of +-1).
    const auto cpu_code = [&](float v) {
      const auto block = torch::tensor({std::clamp(v, -1.0f, 1.0f), 1.0f});
      return quantize_blockwise_8bit(block, map, 2).codes[0].item<int>();
    };
    expect_codes_differ_only_by_the_reciprocal(cuda.codes.cpu().to(torch::kInt), cpu.codes.to(torch::kInt), input,
                                               cpu.absmax, blocksize, cpu_code);
  }
}

// FourBitLinear on CUDA: forward and the input gradient equal x W^T and grad W with W the CPU
// reference's dequantized weight, so the kernel changes nothing but the speed.
TEST(FourBitCuda, LinearForwardAndBackwardUseTheSameWeightAsTheCpuPath) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(26);
  FourBitOptions options;
  options.compute_dtype = torch::kFloat32;
  const auto weight = torch::randn({96, 192}) * 0.05;
  auto layer = FourBitLinear::from_dense(weight, torch::randn({96}), options);
  const auto dense = layer->dense_weight(torch::kFloat32).to(kCuda);  // CPU reference, then moved
  layer->to(kCuda);
  const auto input = torch::randn({4, 7, 192}, torch::TensorOptions().device(kCuda).requires_grad(true));
  const auto output = layer->forward(input);
  const auto expected = torch::nn::functional::linear(input.detach(), dense, layer->bias());
  EXPECT_TRUE(torch::allclose(output.detach(), expected, 1e-5, 1e-6));
  const auto grad_output = torch::randn_like(output);
  output.backward(grad_output);
  EXPECT_TRUE(torch::allclose(input.grad(), grad_output.matmul(dense), 1e-5, 1e-6));
  EXPECT_TRUE(same_bits(layer->dense_weight(torch::kFloat32), dense));
}

}  // namespace
}  // namespace qtrain::qat
