#pragma once
// The fp32 instructions bitsandbytes' kernels run. bnb builds csrc/kernels.cu with --use_fast_math,
// under which nvcc 13 compiles (as its PTX for sm_90a shows)
//   1.0f / x   ->  rcp.approx.ftz.f32  (the SFU's reciprocal: within one fp32 step of the exact one)
//   a * b      ->  mul.ftz.f32
//   fabsf(x)   ->  abs.ftz.f32
//   fmaxf(a,b) ->  max.ftz.f32
// where .ftz flushes subnormal operands and results to a zero of the same sign. Writing these
// instructions out makes our kernels agree with bnb's whatever flags this file is compiled with,
// and keeps nvcc from fusing a product into a following sum that bnb rounds separately.
#include <cuda_runtime.h>

namespace qtrain::kernels::bnb_fast_math {

__device__ __forceinline__ float reciprocal(float x) {
  float result;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
  return result;
}

__device__ __forceinline__ float multiply(float a, float b) {
  float result;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}

__device__ __forceinline__ float absolute(float x) {
  float result;
  asm("abs.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
  return result;
}

__device__ __forceinline__ float maximum(float a, float b) {
  float result;
  asm("max.ftz.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
  return result;
}

// The maximum over a full warp's 32 lanes (every lane gets it). Max is exact, so the order of the
// shuffle reduction does not change the result.
__device__ __forceinline__ float warp_maximum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = maximum(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

}  // namespace qtrain::kernels::bnb_fast_math
