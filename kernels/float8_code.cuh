#pragma once
// The e4m3 code of a value at a row's scale, as c10's Float8_e4m3fn cast rounds it (the torch
// reference, qat/float8_codec.cpp, casts with the same code): shared by the row quantizer
// (kernels/float8_rows.cu) and the 4-bit base's dequantization to FP8 (four_bit_dequantize.cu).
#include <c10/util/Float8_e4m3fn.h>
#include <cuda_fp8.h>

namespace qtrain::kernels {

constexpr float kLargestFloat8Code = 448.0f;  // e4m3fn's largest finite value

// value / scale, clamped to e4m3's range (a NaN stays NaN), cast as c10 casts: round to nearest
// even. From compute capability 8.9 one conversion instruction does it (the clamp makes its
// saturation a no-op; it is c10's software conversion's result, several times cheaper); a NaN
// keeps c10's bits.
__device__ __forceinline__ c10::Float8_e4m3fn float8_code_of(float value, float scale) {
  float code = __fdiv_rn(value, scale);
  code = code > kLargestFloat8Code ? kLargestFloat8Code : (code < -kLargestFloat8Code ? -kLargestFloat8Code : code);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (code == code) {
    return c10::Float8_e4m3fn(__nv_cvt_float_to_fp8(code, __NV_SATFINITE, __NV_E4M3), c10::Float8_e4m3fn::from_bits());
  }
#endif
  return static_cast<c10::Float8_e4m3fn>(code);
}

}  // namespace qtrain::kernels
