// The one-pass integer fake quantization of kernels/fake_quantize.h: one thread per value, the
// block's scale and zero point read through the cache (a block's threads share them).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <string>

#include "kernels/cuda_entry.cuh"
#include "kernels/fake_quantize.h"

namespace qtrain::kernels {

namespace {

__global__ void fake_quantize_int_kernel(const float* __restrict__ x, const float* __restrict__ scale,
                                         const float* __restrict__ zero_point, int64_t n, int64_t block_length,
                                         float quant_min, float quant_max, float* __restrict__ values,
                                         bool* __restrict__ inside) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t block = i / block_length;
    const float s = __ldg(scale + block);
    const float z = __ldg(zero_point + block);
    // torch.round rounds half to even, as rint does; the sum is rounded on its own.
    const float unclamped = __fadd_rn(rintf(__fdiv_rn(x[i], s)), z);
    // torch.clamp keeps a NaN, and the int8 conversion is the same cast torch's .to(int8) makes.
    const float clamped = isnan(unclamped) ? unclamped : fminf(fmaxf(unclamped, quant_min), quant_max);
    const auto code = static_cast<int8_t>(clamped);
    values[i] = __fmul_rn(__fsub_rn(static_cast<float>(code), z), s);
    inside[i] = unclamped >= quant_min && unclamped <= quant_max;
  }
}

}  // namespace

FakeQuantizedValues fake_quantize_int_cuda(const at::Tensor& blocks, const at::Tensor& scale,
                                           const at::Tensor& zero_point, int64_t quant_min, int64_t quant_max) {
  const std::string what = "fake_quantize_int_cuda: ";
  check_cuda_tensor(blocks, what + "blocks");
  check_cuda_operands(blocks, {{&scale, "scale"}, {&zero_point, "zero_point"}}, what);
  check_scalar_type(blocks, at::kFloat, what + "blocks");
  check_scalar_type(scale, at::kFloat, what + "scale");
  check_scalar_type(zero_point, at::kFloat, what + "zero_point");
  const int64_t n = blocks.numel();
  const int64_t block_length = blocks.dim() == 0 ? 1 : blocks.size(-1);
  if (block_length < 1 || scale.numel() * block_length != n || zero_point.numel() != scale.numel() ||
      !(quant_min < quant_max) || quant_min < -128 || quant_max > 127) {
    throw Error(ErrorCode::kInternal, what + "a block view of " + std::to_string(n) + " values in blocks of " +
                                          std::to_string(block_length) + " does not fit " +
                                          std::to_string(scale.numel()) + " scales or the grid [" +
                                          std::to_string(quant_min) + ", " + std::to_string(quant_max) + "]");
  }
  FakeQuantizedValues result{at::empty_like(blocks), at::empty(blocks.sizes(), blocks.options().dtype(at::kBool))};
  if (n == 0) return result;
  const c10::cuda::CUDAGuard device_guard(blocks.device());
  const int64_t wanted = ceil_div(n, kThreads);
  const auto grid = static_cast<unsigned>(wanted < 65535 * 16 ? wanted : 65535 * 16);
  fake_quantize_int_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      blocks.data_ptr<float>(), scale.data_ptr<float>(), zero_point.data_ptr<float>(), n, block_length,
      static_cast<float>(quant_min), static_cast<float>(quant_max), result.values.data_ptr<float>(),
      result.inside.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result;
}

}  // namespace qtrain::kernels
