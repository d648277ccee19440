// MXFP4 (ggml's GGML_TYPE_MXFP4, the OCP microscaling FP4 that gpt-oss ships its experts in): blocks
// of 32 values, one E8M0 scale byte and 16 bytes of E2M1 codes, byte j holding value j (low nibble)
// and value j + 16 (high), as ggml-common.h's block_mxfp4. As ggml-quants.c's quantize_row_mxfp4_ref:
// the scale is 2^(floor(log2(amax)) - 2) (so the largest value lands near the E2M1 grid's top, 6),
// stored as its E8M0 exponent, and each value takes the grid point nearest to it, the first of
// equals in the grid's order. The grid is kept doubled (integers) and the scale halved, as ggml
// keeps them, so that every product is exact.
#include <cmath>
#include <cstring>

#include "qat/gguf_quants.h"

namespace qtrain::qat::gguf_quants {

namespace {

constexpr int64_t kMxfp4Block = 32;  // QK_MXFP4
// E2M1's values doubled, code order (ggml's kvalues_mxfp4): 0 .. 6 then -0 .. -6.
constexpr int8_t kDoubledValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Half of 2^(e - 127), the scale of the doubled values (ggml's GGML_E8M0_TO_FP32_HALF): its
// bits, with the two smallest exponents as subnormals.
float e8m0_to_half_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : uint32_t{e - 1u} << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}

// The first code whose value is nearest to x (ggml's best_index_mxfp4); 0 for a NaN.
uint8_t nearest_code(float x, float scale) {
  uint8_t best = 0;
  float best_error = std::fabs(kDoubledValues[0] * scale - x);
  for (uint8_t code = 1; code < 16; ++code) {
    const float error = std::fabs(kDoubledValues[code] * scale - x);
    if (error < best_error) {
      best = code;
      best_error = error;
    }
  }
  return best;
}

}  // namespace

void quantize_mxfp4(const float* x, uint8_t* out, int64_t n) {
  for (int64_t block = 0; block < n / kMxfp4Block; ++block) {
    const float* values = x + block * kMxfp4Block;
    uint8_t* bytes = out + block * kMxfp4Bytes;
    float amax = 0.0f;
    for (int64_t j = 0; j < kMxfp4Block; ++j) {
      if (amax < std::fabs(values[j])) amax = std::fabs(values[j]);
    }
    // As ggml's C writes it: the float expression converted to uint8_t (x86-64 decides beyond its range).
    const uint8_t e = amax > 0.0f ? static_cast<uint8_t>(static_cast<int32_t>(std::floor(std::log2(amax)) - 2 + 127)) : 0;
    const float scale = e8m0_to_half_scale(e);
    bytes[0] = e;
    for (int64_t j = 0; j < kMxfp4Block / 2; ++j) {
      bytes[1 + j] = static_cast<uint8_t>(nearest_code(values[j], scale) | (nearest_code(values[j + kMxfp4Block / 2], scale) << 4));
    }
  }
}

void dequantize_mxfp4(const uint8_t* in, float* y, int64_t n) {
  for (int64_t block = 0; block < n / kMxfp4Block; ++block) {
    const uint8_t* bytes = in + block * kMxfp4Bytes;
    const float scale = e8m0_to_half_scale(bytes[0]);
    for (int64_t j = 0; j < kMxfp4Block / 2; ++j) {
      y[block * kMxfp4Block + j] = kDoubledValues[bytes[1 + j] & 0x0F] * scale;
      y[block * kMxfp4Block + j + kMxfp4Block / 2] = kDoubledValues[bytes[1 + j] >> 4] * scale;
    }
  }
}

}  // namespace qtrain::qat::gguf_quants
