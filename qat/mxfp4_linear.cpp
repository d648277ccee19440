#include "qat/mxfp4_linear.h"

#include <algorithm>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

// e2m1's sixteen values, the sign in bit 3 (integrations/mxfp4.py FP4_VALUES).
const float kFp4Values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

}  // namespace

Mxfp4Linear::Mxfp4Linear(const torch::Tensor& blocks, const torch::Tensor& scales, const torch::Tensor& bias,
                         torch::ScalarType dtype) {
  if (blocks.dim() != 3 || blocks.size(2) != 16 || blocks.scalar_type() != torch::kUInt8 || scales.scalar_type() != torch::kUInt8 ||
      scales.sizes() != blocks.sizes().slice(0, 2)) {
    throw Error(ErrorCode::kWeights, "MXFP4 weight: blocks " + shape_text(blocks.sizes()) + " and scales " + shape_text(scales.sizes()) +
                                         " are not uint8 [out, in / 32, 16] and [out, in / 32]");
  }
  blocks_ = register_buffer("blocks", blocks.contiguous());
  scales_ = register_buffer("scales", scales.contiguous());
  if (bias.defined()) bias_ = register_buffer("bias", bias.to(dtype));
}

namespace {

// Rows of MXFP4 blocks [rows, in / 32, 16] and scales [rows, in / 32] written into `weight`
// [rows, in] (its dtype), as transformers' dequantization computes them (every value exact in fp32).
void dequantize_mxfp4_into(torch::Tensor weight, const torch::Tensor& blocks, const torch::Tensor& scales) {
  const auto table = torch::from_blob(const_cast<float*>(kFp4Values), {16}, torch::kFloat32).to(blocks.device());
  const int64_t rows = blocks.size(0);
  // [rows, groups, 16, 2]: low nibble first.
  const auto codes = torch::stack({blocks.bitwise_and(0x0F), blocks.bitwise_right_shift(4)}, -1).to(torch::kInt32);
  const auto values = table.index_select(0, codes.reshape(-1)).view({rows, -1, 32});
  const auto exponents = scales.to(torch::kInt32).sub(127).unsqueeze(-1);
  weight.view({rows, -1, 32}).copy_(torch::ldexp(values, exponents));
}

// The decoding above holds about 20 bytes a weight: a whole weight is built this many bytes of
// output at a time (gpt-oss-20b's gate_up bank is 531M weights).
constexpr int64_t kWholeWeightPieceBytes = int64_t{64} << 20;

}  // namespace

torch::Tensor Mxfp4Linear::matmul_weight_rows(torch::ScalarType dtype, int64_t begin, int64_t end) const {
  if (begin < 0 || end > out_features() || begin >= end) {
    throw Error(ErrorCode::kInternal, "rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of an MXFP4 [" +
                                          std::to_string(out_features()) + ", " + std::to_string(in_features()) +
                                          "] weight are not rows of it");
  }
  auto rows = torch::empty({end - begin, in_features()}, blocks_.options().dtype(dtype));
  dequantize_mxfp4_into(rows, blocks_.narrow(0, begin, end - begin), scales_.narrow(0, begin, end - begin));
  return rows;
}

torch::Tensor Mxfp4Linear::dense_weight(torch::ScalarType dtype) const {
  const int64_t out = out_features();
  const int64_t row_bytes = in_features() * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t piece = std::max<int64_t>(kWholeWeightPieceBytes / row_bytes, 1);
  auto weight = torch::empty({out, in_features()}, blocks_.options().dtype(dtype));
  for (int64_t begin = 0; begin < out; begin += piece) {
    const int64_t rows = std::min(out - begin, piece);
    dequantize_mxfp4_into(weight.narrow(0, begin, rows), blocks_.narrow(0, begin, rows), scales_.narrow(0, begin, rows));
  }
  return weight;
}

torch::Tensor Mxfp4Linear::forward(const torch::Tensor& input) {
  return torch::nn::functional::linear(input, dense_weight(input.scalar_type()),
                                       bias_.defined() ? bias_.to(input.scalar_type()) : torch::Tensor());
}

void Mxfp4Linear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::Mxfp4Linear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", bias=" << bias_.defined() << ")";
}

}  // namespace qtrain::qat
