#include "qat/int8_codec.h"

#include <torch/torch.h>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

// bnb's int8_mm_dequant constant, 1 / (127 * 127) as its kernel spells it.
constexpr float kMatmulDequantScale = 6.200012e-05f;
// int8_vectorwise_dequant's 1 / 127 (a Python float, rounded to fp32 by the multiplication).
constexpr double kInverse127 = 7.874015718698502e-3;

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// int8 [m, k] x int8 [n, k]^T -> int32 [m, n], exactly.
torch::Tensor int8_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.is_cuda()) {
    // cuBLASLt's int8 GEMM through _int_mm wants m > 16 and k, n multiples of 8: pad with zero
    // codes (they add nothing) and cut the result back.
    const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
    const int64_t padded_m = std::max<int64_t>(round_up(m, 8), 24), padded_k = round_up(k, 8),
                  padded_n = round_up(n, 8);
    auto a_padded = (padded_m != m || padded_k != k) ? torch::constant_pad_nd(a, {0, padded_k - k, 0, padded_m - m}) : a;
    auto b_padded = (padded_n != n || padded_k != k) ? torch::constant_pad_nd(b, {0, padded_k - k, 0, padded_n - n}) : b;
    return at::_int_mm(a_padded.contiguous(), b_padded.contiguous().t()).narrow(0, 0, m).narrow(1, 0, n);
  }
  // Every partial sum is an integer below 2^53: float64 is exact.
  return a.to(torch::kDouble).mm(b.to(torch::kDouble).t()).to(torch::kInt);
}

}  // namespace

Int8Rows int8_vectorwise_quantize(const torch::Tensor& input, double threshold) {
  if (!(threshold >= 0.0)) {
    throw Error(ErrorCode::kRecipe, "LLM.int8 quantization: the outlier threshold must be >= 0, got " + std::to_string(threshold));
  }
  if (!input.is_floating_point() || input.dim() < 1) {
    throw Error(ErrorCode::kInternal, "LLM.int8 quantization: expected a floating-point tensor [..., columns]");
  }
  const auto values = input.detach().to(torch::kHalf).reshape({-1, input.size(-1)}).to(torch::kFloat);
  const auto magnitude = values.abs();
  Int8Rows result;
  auto kept = magnitude;
  auto inliers = torch::ones_like(magnitude, torch::kBool);
  result.outlier_cols = torch::empty({0}, values.options().dtype(torch::kLong));
  if (threshold > 0.0) {
    const auto outliers = magnitude >= threshold;
    inliers = outliers.logical_not();
    kept = magnitude.masked_fill(outliers, 0.0);
    result.outlier_cols = outliers.any(0).nonzero().view({-1});
  }
  result.absmax = std::get<0>(kept.max(1));
  const auto scale = 127.0f * torch::reciprocal(result.absmax);  // fp32, the reciprocal rounded first
  auto codes = torch::round(values * scale.unsqueeze(1));
  // An all-zero (or all-outlier) row has scale inf: its codes are 0, as the kernel writes them.
  codes = torch::where(inliers & (result.absmax > 0).unsqueeze(1), codes, torch::zeros_like(codes));
  if (values.size(0) > 1 && result.outlier_cols.numel() > 0) codes.index_fill_(1, result.outlier_cols, 0.0);
  result.codes = codes.to(torch::kChar);
  return result;
}

torch::Tensor int8_vectorwise_dequantize(const torch::Tensor& codes, const torch::Tensor& absmax) {
  return codes.to(torch::kFloat) * absmax.to(torch::kFloat).view({-1, 1}) * kInverse127;
}

torch::Tensor int8_mixed_matmul(const torch::Tensor& input, const torch::Tensor& weight_codes,
                                const torch::Tensor& weight_absmax, const torch::Tensor& bias, double threshold) {
  const int64_t in_features = weight_codes.size(1), out_features = weight_codes.size(0);
  if (input.size(-1) != in_features) {
    throw Error(ErrorCode::kInternal, "LLM.int8 matmul: the input has " + std::to_string(input.size(-1)) + " features, the weight " +
                shape_text(weight_codes.sizes()) + " expects " + std::to_string(in_features));
  }
  auto output_shape = input.sizes().vec();
  output_shape.back() = out_features;
  const auto rows = input.reshape({-1, in_features});
  const auto quantized = int8_vectorwise_quantize(rows, threshold);
  const auto accumulated = int8_matmul(quantized.codes, weight_codes).to(torch::kFloat);
  auto scaled = accumulated * quantized.absmax.unsqueeze(1) * weight_absmax.to(torch::kFloat).unsqueeze(0);
  // One fused multiply-add, as the kernel's fmaf: the fp32 product is exact in float64.
  auto fused = scaled.to(torch::kDouble) * static_cast<double>(kMatmulDequantScale);
  if (bias.defined()) fused = fused + bias.to(torch::kFloat).to(torch::kDouble).unsqueeze(0);
  auto output = fused.to(torch::kFloat).to(torch::kHalf).to(input.scalar_type());
  if (quantized.outlier_cols.numel() > 0) {
    const auto outlier_inputs = rows.index_select(1, quantized.outlier_cols);
    const auto outlier_weights =
        int8_vectorwise_dequantize(weight_codes.index_select(1, quantized.outlier_cols), weight_absmax)
            .to(input.scalar_type());
    output = (output.to(torch::kFloat) +
              outlier_inputs.to(torch::kFloat).mm(outlier_weights.to(torch::kFloat).t()))
                 .to(input.scalar_type());
  }
  return output.view(output_shape);
}

}  // namespace qtrain::qat
