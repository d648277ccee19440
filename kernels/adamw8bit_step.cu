// The fused 8-bit AdamW step (kernels/adamw8bit_step.h). One warp per block of 256 values: each
// lane holds 8 of the block's values in registers from dequantization to requantization, the
// block's new absmax values come from a shuffle reduction (max is exact, so its order is free),
// and the codes are picked as kernels/blockwise_quantize.cu picks them.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/adamw8bit_step.h"
#include "kernels/bnb_fast_math.cuh"
#include "kernels/cuda_entry.cuh"
#include "kernels/dynamic_map_code.h"

namespace qtrain::kernels {

namespace {

namespace fast = bnb_fast_math;

constexpr int kBlocksize = 256;
constexpr int kValuesPerLane = kBlocksize / kWarpSize;

__global__ void adamw8bit_step_kernel(float* __restrict__ parameter, const float* __restrict__ grad,
                                      uint8_t* __restrict__ state1, float* __restrict__ absmax1,
                                      uint8_t* __restrict__ state2, float* __restrict__ absmax2,
                                      const float* __restrict__ signed_map, const float* __restrict__ unsigned_map,
                                      int64_t n, int64_t blocks, AdamW8bitStepScalars s) {
  __shared__ float map1[256];
  __shared__ float map2[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    map1[i] = signed_map[i];
    map2[i] = unsigned_map[i];
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kWarpsPerCudaBlock + threadIdx.x / kWarpSize;
  if (block >= blocks) return;  // the whole warp leaves together
  const int64_t first = block * kBlocksize;
  const int count = static_cast<int>(min(static_cast<int64_t>(kBlocksize), n - first));
  const float scale1 = absmax1[block];
  const float scale2 = absmax2[block];

  float m[kValuesPerLane], v[kValuesPerLane];
  float max1 = 0.0f, max2 = 0.0f;
#pragma unroll
  for (int k = 0; k < kValuesPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    m[k] = 0.0f;
    v[k] = 0.0f;
    if (i >= count) continue;
    const int64_t at = first + i;
    const float g = grad[at];
    const float p = parameter[at];
    // Each product and sum rounded on its own, as the reference's torch operations round them.
    float second = __fadd_rn(__fmul_rn(__fmul_rn(map2[state2[at]], scale2), s.beta2),
                             __fmul_rn(__fmul_rn(g, s.one_minus_beta2), g));
    float moment = __fadd_rn(__fmul_rn(__fmul_rn(map1[state1[at]], scale1), s.beta1), __fmul_rn(g, s.one_minus_beta1));
    if (isfinite(g)) {
      const float denominator = __fadd_rn(__fsqrt_rn(second), s.eps_term);
      float updated = __fadd_rn(p, __fmul_rn(__fdiv_rn(moment, denominator), s.step_size));
      if (s.apply_decay) updated = __fmul_rn(updated, s.decay_factor);
      parameter[at] = updated;
    } else {
      second = 0.0f;  // a non-finite gradient zeroes its moments and leaves the weight
      moment = 0.0f;
    }
    m[k] = moment;
    v[k] = second;
    max1 = fast::maximum(max1, fast::absolute(moment));
    max2 = fast::maximum(max2, fast::absolute(second));
  }
  max1 = fast::warp_maximum(max1);
  max2 = fast::warp_maximum(max2);
  if (lane == 0) {
    absmax1[block] = max1;
    absmax2[block] = max2;
  }
  const float inverse1 = fast::reciprocal(max1);
  const float inverse2 = fast::reciprocal(max2);
#pragma unroll
  for (int k = 0; k < kValuesPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    if (i >= count) continue;
    const int64_t at = first + i;
    uint8_t code1 = dynamic_map_code(map1, fast::multiply(m[k], inverse1));
    // A code of the other sign than the moment moves one step towards the moment's sign.
    if (signbit(map1[code1]) != signbit(m[k])) code1 = static_cast<uint8_t>(code1 + (m[k] > 0.0f ? 1 : -1));
    state1[at] = code1;
    state2[at] = dynamic_map_code(map2, fast::multiply(v[k], inverse2));
  }
}

}  // namespace

void adamw8bit_step_cuda(at::Tensor& parameter, const at::Tensor& grad, at::Tensor& state1, at::Tensor& absmax1,
                         at::Tensor& state2, at::Tensor& absmax2, const at::Tensor& signed_map,
                         const at::Tensor& unsigned_map, const AdamW8bitStepScalars& scalars) {
  const std::string what = "adamw8bit_step_cuda: ";
  const int64_t n = parameter.numel();
  const int64_t blocks = ceil_div(n, kBlocksize);
  check_cuda_tensor(parameter, what + "parameter");
  check_scalar_type(parameter, at::kFloat, what + "parameter");
  check_cuda_operands(parameter,
                      {{&grad, "grad"}, {&state1, "state1"}, {&absmax1, "absmax1"}, {&state2, "state2"},
                       {&absmax2, "absmax2"}, {&signed_map, "signed_map"}, {&unsigned_map, "unsigned_map"}},
                      what);
  check_scalar_type(grad, at::kFloat, what + "grad");
  check_scalar_type(state1, at::kByte, what + "state1");
  check_scalar_type(state2, at::kByte, what + "state2");
  if (grad.numel() != n || state1.numel() != n || state2.numel() != n || absmax1.numel() != blocks ||
      absmax2.numel() != blocks || signed_map.numel() != 256 || unsigned_map.numel() != 256) {
    throw Error(ErrorCode::kInternal, what + "sizes do not fit a parameter of " + std::to_string(n) + " values");
  }
  if (n == 0) return;
  const c10::cuda::CUDAGuard device_guard(parameter.device());
  const auto grid = static_cast<unsigned>(ceil_div(blocks, kWarpsPerCudaBlock));
  adamw8bit_step_kernel<<<grid, kWarpSize * kWarpsPerCudaBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      parameter.data_ptr<float>(), grad.data_ptr<float>(), state1.data_ptr<uint8_t>(), absmax1.data_ptr<float>(),
      state2.data_ptr<uint8_t>(), absmax2.data_ptr<float>(), signed_map.data_ptr<float>(),
      unsigned_map.data_ptr<float>(), n, blocks, scalars);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace qtrain::kernels
