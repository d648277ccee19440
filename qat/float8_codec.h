#pragma once
// Row-wise FP8 (e4m3) quantization: the format of the FP8 base's weights (one scale per output
// row, qat/float8_linear.h) and of the activations and gradients its matmuls quantize on the fly
// (one scale per token, qat/float8_matmul.h). kernels/float8_rows.h gives the arithmetic:
//     scale[r] = max(max_j |v[r, j]|, 1e-12) / 448,   codes[r, j] = e4m3(clamp(v[r, j] / scale[r], +-448)),
// with v = x * column_scale (column_scale absent: v = x), so v ~= codes * scale. e4m3 keeps 3
// mantissa bits: each value within 2^-4 of itself relative (round to nearest even), values below
// 2^-6 * scale as subnormals down to 2^-9 * scale, smaller ones to zero.
//
// Where it runs: CUDA tensors go to one kernel (kernels/float8_rows.h) when this build has its CUDA
// kernels, everything else to the torch operations here; both give the same bytes.
#include <torch/types.h>

namespace qtrain::qat {

struct Float8Rows {
  torch::Tensor codes;   // float8_e4m3fn [rows, columns]
  torch::Tensor scales;  // fp32 [rows, 1]
};

constexpr double kFloat8LargestCode = 448.0;  // e4m3fn's largest finite value

// input [rows, columns] (fp32, fp16 or bf16), column_scale fp32 [columns] or undefined.
Float8Rows quantize_rows_float8(const torch::Tensor& input, const torch::Tensor& column_scale = torch::Tensor());
// The torch-operation path (every device): what the CUDA kernel is checked against.
Float8Rows quantize_rows_float8_reference(const torch::Tensor& input, const torch::Tensor& column_scale = torch::Tensor());

// codes * scales in fp32, then cast to `dtype`.
torch::Tensor dequantize_rows_float8(const Float8Rows& rows, torch::ScalarType dtype);

}  // namespace qtrain::qat
