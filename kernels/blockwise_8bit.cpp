#include "kernels/blockwise_8bit.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/blockwise_quantize.h"
#include "kernels/blockwise_reference.h"
#include "kernels/dynamic_map_code.h"
#include "kernels/error.h"

namespace qtrain::kernels {

namespace {

at::Tensor make_dynamic_map(bool is_signed) {
  constexpr int kMaxExponentBits = 7;
  std::vector<float> values;
  for (int exponent_index = 0; exponent_index < kMaxExponentBits; ++exponent_index) {
    const int64_t segments = int64_t{1} << (exponent_index + (is_signed ? 0 : 1));
    const auto boundaries = torch::linspace(0.1, 1.0, segments + 1, torch::kFloat32);
    const auto means = (boundaries.slice(0, 0, -1) + boundaries.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -(kMaxExponentBits - 1) + exponent_index);
    for (const double sign : {1.0, -1.0}) {
      if (sign < 0 && !is_signed) continue;
      const auto scaled = (means * (sign * scale)).contiguous();
      const float* data = scaled.data_ptr<float>();
      values.insert(values.end(), data, data + scaled.numel());
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  std::sort(values.begin(), values.end());
  return torch::tensor(values, torch::kFloat32);
}

}  // namespace

at::Tensor signed_dynamic_map() {
  static const at::Tensor map = make_dynamic_map(/*is_signed=*/true);
  return map;
}

at::Tensor unsigned_dynamic_map() {
  static const at::Tensor map = make_dynamic_map(/*is_signed=*/false);
  return map;
}

BlockwiseQuantized quantize_blockwise_8bit(const at::Tensor& input, const at::Tensor& code, int64_t blocksize) {
  if (code.numel() != 256) throw Error(ErrorCode::kInternal, "8-bit blockwise quantization needs a 256-entry code");
  if (blocksize < 1) throw Error(ErrorCode::kRecipe, "8-bit blockwise quantization: blocksize must be >= 1, got " + std::to_string(blocksize));
  if (kCudaKernelsBuilt && input.is_cuda()) {
    const auto type = input.scalar_type();
    const bool readable = type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16;
    const auto flat = (readable ? input.detach() : input.detach().to(torch::kFloat32)).contiguous().view(-1);
    auto quantized = quantize_blockwise_8bit_cuda(flat, code.to(input.device(), torch::kFloat32).contiguous(), blocksize);
    return {quantized.codes.view(input.sizes()), quantized.absmax};
  }
  const auto values = input.detach().to(torch::kCPU, torch::kFloat32).contiguous().view(-1);
  const auto code_values = code.to(torch::kCPU, torch::kFloat32).contiguous();
  const int64_t n = values.numel();
  auto codes = torch::empty({n}, torch::kUInt8);
  auto absmax = torch::empty({ceil_div(n, blocksize)}, torch::kFloat32);
  const float* x = values.data_ptr<float>();
  const float* table = code_values.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* absmax_out = absmax.data_ptr<float>();
  for_each_block(n, blocksize, [&](int64_t block, int64_t first, int64_t last) {
    const float block_max = block_absmax(x, first, last);
    absmax_out[block] = block_max;
    const float inverse = 1.0f / block_max;
    for (int64_t i = first; i < last; ++i) out[i] = dynamic_map_code(table, x[i] * inverse);
  });
  return {codes.view(input.sizes()).to(input.device()), absmax.to(input.device())};
}

at::Tensor dequantize_blockwise_8bit(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
                                     int64_t blocksize) {
  const int64_t n = codes.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  if (absmax.numel() != blocks) {
    throw Error(ErrorCode::kCheckpoint, "8-bit blockwise dequantization: " + std::to_string(n) + " codes in blocks of " +
                std::to_string(blocksize) + " need " + std::to_string(blocks) + " absmax values, got " +
                std::to_string(absmax.numel()));
  }
  auto values = code.to(codes.device(), torch::kFloat32).index_select(0, codes.reshape({-1}).to(torch::kLong));
  values = torch::constant_pad_nd(values, {0, blocks * blocksize - n}).view({blocks, blocksize});
  values = values * absmax.to(codes.device(), torch::kFloat32).view({blocks, 1});
  return values.view({-1}).narrow(0, 0, n).view(codes.sizes());
}

}  // namespace qtrain::kernels
