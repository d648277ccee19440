#pragma once
// IEEE half precision as ggml converts it (ggml-impl.h's GGML_FP32_TO_FP16 / GGML_FP16_TO_FP32,
// which its quantizers and dequantizers call), as the bits of the half: the scales of every GGUF
// block type are stored this way. Free of LibTorch, like the quantizers that use it
// (qat/gguf_quants.h). Checked against ggml's ggml_fp32_to_fp16 on all 2^32 floats and against
// ggml_fp16_to_fp32 on all 2^16 halves.
#include <cstdint>
#include <cstring>

namespace qtrain::qat::gguf_quants {

// Round to nearest, ties to even; magnitudes from 65520 up (infinity included) become infinity,
// those below the smallest subnormal half round to a signed zero. A NaN becomes the quiet NaN
// 0x7E00 with the input's sign (ggml drops the payload).
inline uint16_t fp16_bits_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00u;  // NaN
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520: rounds past 65504
  if (magnitude >= 0x38800000u) {
    // A normal half (>= 2^-14): rebias the exponent (127 -> 15), keep the top 10 of the 23
    // mantissa bits and round on the 13 dropped ones. A carry out of the mantissa moves into the
    // exponent, which is the right next half.
    uint32_t half = (magnitude - 0x38000000u) >> 13;
    const uint32_t dropped = magnitude & 0x1FFFu;
    if (dropped > 0x1000u || (dropped == 0x1000u && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  // A subnormal half counts units of 2^-24; 2^-25 and below round to zero (2^-25 is a tie whose
  // even neighbour is zero).
  if (magnitude <= 0x33000000u) return sign;
  const uint32_t exponent = magnitude >> 23;                      // 102..112
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;  // with the implicit 1
  const uint32_t shift = 126 - exponent;                           // 14..24: value / 2^-24 = significand >> shift
  uint32_t units = significand >> shift;
  const uint32_t dropped = significand & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (dropped > halfway || (dropped == halfway && (units & 1u))) ++units;  // may become 0x400, the smallest normal
  return static_cast<uint16_t>(sign | units);
}

// Exact for every finite half. A NaN keeps its payload and comes back quiet (ggml's conversion
// passes it through a multiplication), an infinity stays one.
inline float float_from_fp16_bits(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1Fu;
  const uint32_t mantissa = half & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u);
  } else if (exponent == 0) {
    // Subnormal (or zero): mantissa units of 2^-24, a normal float once scaled.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace qtrain::qat::gguf_quants
