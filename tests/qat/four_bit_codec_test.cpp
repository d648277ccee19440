// The 4-bit codec against definitions we compute independently in float64: the code picked for
// a normalized weight is the nearest table value, packing puts the first element in the high
// nibble, dequantization is table[code] * absmax. bitsandbytes' own outputs (the 24 cases of
// bnb-4bit-reference.safetensors) are checked in tests/trainer/bnb_checkpoint_test.cpp, which
// links the safetensors reader.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "kernels/error.h"
#include "qat/four_bit_codec.h"
#include "qat/four_bit_format.h"

namespace qtrain::qat {
namespace {

// Index of the table value nearest to x in float64, the lower one on an exact tie.
int nearest_code(const FourBitFormat& format, double x) {
  int best = -1;
  double best_distance = INFINITY;
  double best_value = INFINITY;
  for (int code = 0; code < 16; ++code) {
    const double value = format.code[code];
    const double distance = std::fabs(x - value);
    if (distance < best_distance || (distance == best_distance && value < best_value)) {
      best = code;
      best_distance = distance;
      best_value = value;
    }
  }
  return best;
}

// The exact (float64) midpoint of the two table values a code choice hesitates between.
double exact_midpoint(const FourBitFormat& format, int code_a, int code_b) {
  return (static_cast<double>(format.code[code_a]) + static_cast<double>(format.code[code_b])) / 2.0;
}

torch::Tensor unpack_codes(const torch::Tensor& packed, int64_t n) {
  const auto bytes = packed.reshape({-1}).to(torch::kInt);
  return torch::stack({torch::bitwise_right_shift(bytes, 4), torch::bitwise_and(bytes, 15)}, 1).reshape({-1}).narrow(0, 0, n);
}

TEST(FourBitFormat, TablesHaveBitsandbytesValues) {
  const auto& nf4 = four_bit_format(FourBitType::kNf4);
  EXPECT_EQ(nf4.code[0], -1.0f);
  EXPECT_EQ(nf4.code[7], 0.0f);
  EXPECT_EQ(nf4.code[15], 1.0f);
  // Every pivot is within one fp32 step of the exact midpoint of its two codes.
  for (size_t index = 0; index < nf4.thresholds.size(); ++index) {
    const double midpoint = exact_midpoint(nf4, static_cast<int>(index), static_cast<int>(index) + 1);
    EXPECT_LE(std::fabs(nf4.thresholds[index] - midpoint), 6e-8) << index;
  }
  const auto& fp4 = four_bit_format(FourBitType::kFp4);
  EXPECT_EQ(fp4.code[3], 1.0f);
  EXPECT_EQ(fp4.code[2], 8.0f / 12.0f);
  EXPECT_EQ(fp4.code[1], 0.0625f / 12.0f);
  EXPECT_FALSE(std::signbit(fp4.code[8]));
  EXPECT_TRUE(std::signbit(fp4.decode[8]));
  EXPECT_EQ(parse_four_bit_type("fp4", "x"), FourBitType::kFp4);
  EXPECT_THROW(parse_four_bit_type("int4", "config.json: bnb_4bit_quant_type"), Error);
}

TEST(FourBitFormat, SignedDynamicMapIsSortedIn256Steps) {
  const auto map = signed_dynamic_map();
  ASSERT_EQ(map.numel(), 256);
  EXPECT_TRUE(torch::equal(std::get<0>(map.sort()), map));
  EXPECT_EQ(map[255].item<float>(), 1.0f);
  EXPECT_NEAR(map[0].item<float>(), -0.99297, 1e-5);
  EXPECT_EQ((map == 0).sum().item<int64_t>(), 1);
}

// Ties: a value exactly on a pivot goes to the lower code (the kernels test x > pivot).
TEST(FourBitFormat, ValueOnAPivotGoesToTheLowerCode) {
  for (const auto type : {FourBitType::kNf4, FourBitType::kFp4}) {
    const auto& format = four_bit_format(type);
    for (size_t rank = 0; rank < format.thresholds.size(); ++rank) {
      const float pivot = format.thresholds[rank];
      EXPECT_EQ(format.quantize(pivot), format.code_of_rank[rank]) << format.name << " pivot " << pivot;
      EXPECT_EQ(format.quantize(std::nextafter(pivot, 2.0f)), format.code_of_rank[rank + 1]) << format.name;
    }
  }
  // FP4 is sign-magnitude: -x mirrors x (the lower magnitude on a tie), -0.0 is code 0.
  const auto& fp4 = four_bit_format(FourBitType::kFp4);
  EXPECT_EQ(fp4.quantize(-fp4.thresholds[2]), fp4.code_of_rank[2] | 8);
  EXPECT_EQ(fp4.quantize(-0.0f), 0);
}

// On fresh random inputs the code is the float64-nearest one except in the sliver between a
// pivot (rounded to fp32, or written with 6-7 decimals for FP4) and the exact midpoint.
TEST(FourBitCodec, PicksTheNearestCodeExceptBetweenPivotAndExactMidpoint) {
  torch::manual_seed(7);
  for (const auto type : {FourBitType::kNf4, FourBitType::kFp4}) {
    const auto& format = four_bit_format(type);
    for (const int64_t blocksize : {64, 256, 4096}) {
      auto input = torch::randn({64, 257}) * torch::rand({64, 1}) * 3;
      input.view(-1).narrow(0, 0, 999).mul_(torch::rand({999}).pow(4));  // heavy-tailed blocks too
      const auto quantized = quantize_4bit(input, type, blocksize, false);
      const int64_t n = input.numel();
      const auto codes = unpack_codes(quantized.packed, n);
      const auto absmax = quantized.state.absmax;
      const auto flat = input.reshape({-1});
      int64_t disagreements = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float inverse = 1.0f / absmax[i / blocksize].item<float>();
        const float normalized = flat[i].item<float>() * inverse;
        const int ours = codes[i].item<int>();
        const int nearest = nearest_code(format, normalized);
        if (format.code[ours] == format.code[nearest]) continue;  // FP4's +0 and -0 are one value
        ++disagreements;
        // The exact midpoint between the two candidates and bnb's pivot bracket the value.
        const double midpoint = exact_midpoint(format, ours, nearest);
        const double magnitude = format.sign_magnitude ? std::fabs(normalized) : normalized;
        const double midpoint_magnitude = format.sign_magnitude ? std::fabs(midpoint) : midpoint;
        EXPECT_LT(std::fabs(magnitude - midpoint_magnitude), 5e-7)
            << format.name << " x=" << normalized << " ours " << ours << " nearest " << nearest;
      }
      EXPECT_LT(disagreements, 5) << format.name << " blocksize " << blocksize;
    }
  }
}

TEST(FourBitCodec, PacksTheFirstElementInTheHighNibble) {
  // One block of 64: absmax 1; values chosen to be exact table entries.
  const auto& nf4 = four_bit_format(FourBitType::kNf4);
  auto input = torch::zeros({64});
  input[0] = nf4.code[15];  // 1.0 -> code 15
  input[1] = nf4.code[2];
  input[2] = nf4.code[0];
  const auto quantized = quantize_4bit(input, FourBitType::kNf4, 64, false);
  EXPECT_EQ(quantized.packed.sizes(), (std::vector<int64_t>{32, 1}));
  EXPECT_EQ(quantized.packed[0][0].item<int>(), 0xF2);
  EXPECT_EQ(quantized.packed[1][0].item<int>(), 0x07);  // -1.0, then 0.0 = code 7
}

TEST(FourBitCodec, OddSizesUseAPartialLastBlockAndPadTheLastNibble) {
  torch::manual_seed(3);
  const auto input = torch::randn({3, 67});  // 201 values: 3 blocks of 64 + 9
  for (const auto type : {FourBitType::kNf4, FourBitType::kFp4}) {
    const auto quantized = quantize_4bit(input, type, 64, true);
    EXPECT_EQ(quantized.packed.size(0), 101);
    EXPECT_EQ(quantized.state.absmax.numel(), 4);
    EXPECT_FLOAT_EQ(dequantize_absmax(quantized.state)[3].item<float>(),
                    dequantize_absmax(quantized.state)[3].item<float>());
    const int last_low = quantized.packed[100][0].item<int>() & 15;
    EXPECT_EQ(last_low, four_bit_format(type).quantize(0.0f));
    const auto restored = dequantize_4bit(quantized.packed, quantized.state, torch::kFloat32);
    EXPECT_EQ(restored.sizes(), input.sizes());
    EXPECT_LT((restored - input).abs().max().item<float>(), 0.35f * input.abs().max().item<float>());
  }
}

// table[code] * absmax, independently in float64, rounded once to the asked dtype.
TEST(FourBitCodec, DequantizesToTableTimesAbsmaxInTheAskedDtype) {
  torch::manual_seed(11);
  const auto input = torch::randn({16, 128}, torch::kBFloat16);
  for (const auto type : {FourBitType::kNf4, FourBitType::kFp4}) {
    const auto quantized = quantize_4bit(input, type, 128, false);
    const auto codes = unpack_codes(quantized.packed, input.numel()).to(torch::kLong);
    const auto table = four_bit_decode_tensor(type).to(torch::kDouble);
    const auto expected = (table.index_select(0, codes).view({16, 128}) *
                           quantized.state.absmax.to(torch::kDouble).view({16, 1}));
    for (const auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
      const auto restored = dequantize_4bit(quantized.packed, quantized.state, dtype);
      EXPECT_EQ(restored.scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(restored, expected.to(torch::kFloat32).to(dtype)));
    }
  }
}

// Double quantization: absmax - mean goes through the 8-bit dynamic map in blocks of 256; the
// rebuilt absmax is within half a step of that map (at most ~1/64 of the nested absmax).
TEST(FourBitCodec, DoubleQuantizationKeepsAbsmaxWithinTheDynamicMapsStep) {
  torch::manual_seed(5);
  const auto input = torch::randn({300, 64});
  const auto plain = quantize_4bit(input, FourBitType::kNf4, 64, false);
  const auto nested = quantize_4bit(input, FourBitType::kNf4, 64, true);
  EXPECT_TRUE(torch::equal(plain.packed, nested.packed));
  ASSERT_TRUE(nested.state.double_quant());
  EXPECT_EQ(nested.state.absmax.scalar_type(), torch::kUInt8);
  EXPECT_EQ(nested.state.nested_absmax.numel(), 2);  // 300 absmax values in blocks of 256
  EXPECT_NEAR(nested.state.offset, plain.state.absmax.mean().item<float>(), 1e-6);
  const auto rebuilt = dequantize_absmax(nested.state);
  const float nested_max = nested.state.nested_absmax.max().item<float>();
  EXPECT_LT((rebuilt - plain.state.absmax).abs().max().item<float>(), nested_max / 32);
}

TEST(FourBitCodec, BlockwiseEightBitPicksANearestDynamicMapCode) {
  torch::manual_seed(9);
  const auto input = torch::randn({1000});
  const auto map = signed_dynamic_map();
  const auto quantized = quantize_blockwise_8bit(input, map, 256);
  const auto map64 = map.to(torch::kDouble);
  for (int64_t i = 0; i < input.numel(); ++i) {
    const float normalized = input[i].item<float>() * (1.0f / quantized.absmax[i / 256].item<float>());
    const double chosen = std::fabs(map64[quantized.codes[i].item<int>()].item<double>() - normalized);
    const double best = (map64 - normalized).abs().min().item<double>();
    EXPECT_LE(chosen - best, 1e-7) << "value " << normalized;
  }
  const auto restored = dequantize_blockwise_8bit(quantized.codes, quantized.absmax, map, 256);
  EXPECT_LT((restored - input).abs().max().item<float>(), 0.05f);
}

TEST(FourBitCodec, RejectsBlocksizesBitsandbytesDoesNotHave) {
  const auto input = torch::randn({4, 64});
  for (const int64_t blocksize : {0, 32, 100, 8192}) {
    try {
      quantize_4bit(input, FourBitType::kNf4, blocksize, false);
      FAIL() << "blocksize " << blocksize << " was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(std::to_string(blocksize)), std::string::npos) << error.what();
    }
  }
}

TEST(FourBitCodec, RejectsAQuantStateWhoseShapesDisagree) {
  auto quantized = quantize_4bit(torch::randn({8, 64}), FourBitType::kNf4, 64, true);
  quantized.state.shape = {8, 128};
  EXPECT_THROW(quantized.state.check(quantized.packed, "w"), Error);
  quantized.state.shape = {8, 64};
  quantized.state.check(quantized.packed, "w");
  quantized.state.nested_absmax = torch::zeros({3});
  EXPECT_THROW(quantized.state.check(quantized.packed, "w"), Error);
}

}  // namespace
}  // namespace qtrain::qat
