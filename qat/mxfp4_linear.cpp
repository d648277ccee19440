#include "qat/mxfp4_linear.h"

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

torch::Tensor Mxfp4Linear::dense_weight(torch::ScalarType dtype) const {
  const auto table = torch::from_blob(const_cast<float*>(kFp4Values), {16}, torch::kFloat32).to(blocks_.device());
  const auto bytes = blocks_.to(torch::kInt64);
  // [out, groups, 16, 2]: low nibble first.
  const auto codes = torch::stack({bytes.bitwise_and(0x0F), bytes.bitwise_right_shift(4)}, -1);
  const auto values = table.index_select(0, codes.reshape(-1)).view(codes.sizes()).reshape({out_features(), -1, 32});
  const auto exponents = scales_.to(torch::kInt32).sub(127).unsqueeze(-1);
  return torch::ldexp(values, exponents).reshape({out_features(), in_features()}).to(dtype);
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
