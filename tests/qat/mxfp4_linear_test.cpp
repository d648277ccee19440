// gpt-oss's MXFP4 base (qat/mxfp4_linear.h): the weight decodes as the format says, e2m1 codes
// (low nibble first) times 2^(scale - 127); rows build alone as the whole weight's, and a weight
// larger than its build piece is built piece by piece to the same values.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/error.h"
#include "qat/mxfp4_linear.h"

namespace qtrain::qat {
namespace {

// e2m1 decoded from its bits: sign, two exponent bits (bias 1), one mantissa bit; exponent 0 is
// subnormal (0 or 0.5).
float e2m1(int code) {
  const int exponent = (code >> 1) & 3, mantissa = code & 1;
  const float magnitude = exponent == 0 ? 0.5f * mantissa : std::ldexp(1.0f + 0.5f * mantissa, exponent - 1);
  return (code & 8) ? -magnitude : magnitude;
}

TEST(Mxfp4Linear, DecodesE2m1CodesTimesTheBlocksPowerOfTwo) {
  torch::manual_seed(3);
  const int64_t out = 6, in = 64;
  const auto blocks = torch::randint(256, {out, in / 32, 16}, torch::kUInt8);
  const auto scales = torch::randint(110, 140, {out, in / 32}, torch::kUInt8);
  const Mxfp4Linear layer(blocks, scales, torch::Tensor(), torch::kFloat32);
  auto expected = torch::empty({out, in});
  for (int64_t row = 0; row < out; ++row) {
    for (int64_t column = 0; column < in; ++column) {
      const int byte = blocks[row][column / 32][(column % 32) / 2].item<int>();
      const int code = column % 2 == 0 ? (byte & 15) : (byte >> 4);
      expected[row][column] = std::ldexp(e2m1(code), scales[row][column / 32].item<int>() - 127);
    }
  }
  EXPECT_TRUE(torch::equal(layer.dense_weight(torch::kFloat32), expected));
  EXPECT_TRUE(torch::equal(layer.matmul_weight_rows(torch::kFloat32, 2, 5), expected.narrow(0, 2, 3)));
  EXPECT_TRUE(layer.builds_weight_rows());
  EXPECT_THROW(layer.matmul_weight_rows(torch::kFloat32, 4, 7), Error);
  EXPECT_THROW(layer.matmul_weight_rows(torch::kFloat32, 3, 3), Error);
}

// 4,196 rows of 4,096 fp32 values: more than one 64 MB piece.
TEST(Mxfp4Linear, AWeightBuiltInPiecesEqualsItsRows) {
  torch::manual_seed(4);
  const int64_t out = 4196, in = 4096;
  const Mxfp4Linear layer(torch::randint(256, {out, in / 32, 16}, torch::kUInt8), torch::randint(115, 130, {out, in / 32}, torch::kUInt8),
                          torch::Tensor(), torch::kFloat32);
  const auto whole = layer.dense_weight(torch::kFloat32);
  EXPECT_TRUE(torch::equal(whole.narrow(0, 0, 1000), layer.matmul_weight_rows(torch::kFloat32, 0, 1000)));
  EXPECT_TRUE(torch::equal(whole.narrow(0, 4000, 196), layer.matmul_weight_rows(torch::kFloat32, 4000, 4196)));
  EXPECT_TRUE(torch::equal(whole.narrow(0, 4090, 10), layer.matmul_weight_rows(torch::kFloat32, 4090, 4100)));
}

}  // namespace
}  // namespace qtrain::qat
