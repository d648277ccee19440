#include "qat/float8_codec.h"

#include "kernels/cuda_build.h"
#include "kernels/error.h"
#include "kernels/float8_rows.h"

namespace qtrain::qat {

namespace {

constexpr double kSmallestAbsmax = 1e-12;  // kernels/float8_rows.cu's floor: a row of zeros gets codes 0

void check_rows(const torch::Tensor& input, const torch::Tensor& column_scale) {
  if (input.dim() != 2) throw Error(ErrorCode::kInternal, "quantize_rows_float8: the input must be [rows, columns]");
  if (column_scale.defined() && (column_scale.numel() != input.size(1) || column_scale.scalar_type() != torch::kFloat32)) {
    throw Error(ErrorCode::kInternal, "quantize_rows_float8: column_scale must be fp32 with one value per column");
  }
}

}  // namespace

Float8Rows quantize_rows_float8_reference(const torch::Tensor& input, const torch::Tensor& column_scale) {
  check_rows(input, column_scale);
  auto values = input.to(torch::kFloat32);
  if (column_scale.defined()) values = values * column_scale.to(values.device()).view({1, -1});
  // amax and clamp_min keep a NaN (the kernel's order of comparisons does too). The divisor is a
  // tensor on the values' device: CUDA divides by a scalar as a product with its rounded reciprocal.
  const auto absmax = values.abs().amax(1, /*keepdim=*/true).clamp_min(kSmallestAbsmax);
  const auto scales = absmax / torch::full_like(absmax, kFloat8LargestCode);
  const auto codes = (values / scales).clamp(-kFloat8LargestCode, kFloat8LargestCode).to(torch::kFloat8_e4m3fn);
  return {codes, scales};
}

Float8Rows quantize_rows_float8(const torch::Tensor& input, const torch::Tensor& column_scale) {
  check_rows(input, column_scale);
  if (kernels::kCudaKernelsBuilt && input.is_cuda()) {
    auto [codes, scales] = kernels::quantize_rows_float8_cuda(
        input.contiguous(), column_scale.defined() ? column_scale.to(input.device()).contiguous() : column_scale);
    return {codes, scales};
  }
  return quantize_rows_float8_reference(input, column_scale);
}

torch::Tensor dequantize_rows_float8(const Float8Rows& rows, torch::ScalarType dtype) {
  return (rows.codes.to(torch::kFloat32) * rows.scales).to(dtype);
}

}  // namespace qtrain::qat
