// ggml's legacy block types, blocks of 32 values with one fp16 scale d (and, for the "_1" types, an
// fp16 minimum m), quantized as ggml-quants.c's quantize_row_q*_ref and dequantized as its
// dequantize_row_q* do, operation for operation, so that the bytes and floats are the same:
//
//   Q4_0 / Q5_0  symmetric: d = -(the value of largest magnitude) / 2^(bits-1), which puts that
//                value on code 0; code = min(2^bits - 1, trunc(x / d + 2^(bits-1) + 0.5));
//                value = (code - 2^(bits-1)) * d
//   Q4_1 / Q5_1  asymmetric: d = (max - min) / (2^bits - 1), m = min;
//                code = trunc((x - min) / d + 0.5); value = code * d + m
//   Q8_0         d = max |x| / 127; code = round(x / d) (half away from zero); value = code * d
//
// "/ d" is a multiplication by the fp32 reciprocal 1 / d (0 where d is 0), and the codes are
// computed from the fp32 d and min, not from their fp16 roundings that the block stores.
//
// Two things a plain port would get wrong:
//  - ggml's float-to-integer casts are truncations whose out-of-range results C leaves undefined;
//    its x86-64 build (llama-cpp-python's here, like llama-quantize's) computes them with
//    cvttss2si / cvttps2dq, which give INT32_MIN for NaN and out-of-range values, and keeps the low
//    byte. That case arises for blocks holding infinities or NaNs, or whose scale is so small
//    that 1 / d overflows; truncate_as_x86 reproduces it without undefined behaviour.
//  - ggml rounds every product before the addition that follows (libggml-base is compiled for
//    baseline x86-64, without FMA). A compiler allowed to fuse x * (1 / d) + 8.5 into one
//    multiply-add (GCC's default where the target has FMA: -march=native, AArch64) rounds once and
//    moves codes that sit at a rounding boundary; the pragmas below forbid it in this file.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "qat/ggml_rounding.h"
#include "qat/gguf_block_format.h"
#include "qat/gguf_fp16.h"
#include "qat/gguf_quant_blocks.h"
#include "qat/gguf_quants.h"

QTRAIN_GGML_ROUNDING_BEGIN  // ggml's roundings, no contraction (qat/ggml_rounding.h)

namespace qtrain::qat::gguf_quants {

namespace {

constexpr int kBlock = static_cast<int>(kGgufBlockElements);  // QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0
constexpr int kHalfBlock = kBlock / 2;  // qs byte j holds elements j (low nibble) and j + 16 (high)

// ggml-common.h's structs not in qat/gguf_block_format.h (which has Q4_0 and Q8_0); fp16 fields
// are kept as their bits. qh holds the fifth bit of each code: bit j for element j, little-endian.
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[kHalfBlock];
};
static_assert(sizeof(BlockQ4_1) == kQ4_1Bytes, "wrong q4_1 block size/padding");

struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[kHalfBlock];
};
static_assert(sizeof(BlockQ5_0) == kQ5_0Bytes, "wrong q5_0 block size/padding");

struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[kHalfBlock];
};
static_assert(sizeof(BlockQ5_1) == kQ5_1Bytes, "wrong q5_1 block size/padding");

// A float truncated toward zero as x86-64's cvttss2si does it: NaN and values outside int32's
// range give INT32_MIN, whose low byte (what ggml's (int8_t) / (uint8_t) casts keep) is 0.
int32_t truncate_as_x86(float value) {
  if (!(value >= -2147483648.0f && value < 2147483648.0f)) return INT32_MIN;
  return static_cast<int32_t>(value);
}

// ggml's (int8_t) cast of a float: the truncation's low byte, as a signed byte.
int low_byte_signed(float value) { return static_cast<int8_t>(truncate_as_x86(value) & 0xFF); }

float inverse_or_zero(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// The block's value of largest magnitude, with its sign; the first of equal magnitudes; 0 for a
// block of zeros. NaNs never win (the comparison is false).
float largest_magnitude(const float* x) {
  float magnitude = 0.0f;
  float value = 0.0f;
  for (int j = 0; j < kBlock; ++j) {
    if (magnitude < std::fabs(x[j])) {
      magnitude = std::fabs(x[j]);
      value = x[j];
    }
  }
  return value;
}

// Q4_0 / Q5_0's codes (0 .. 2^bits - 1) of one block; returns d in fp32.
template <int kBits>
float symmetric_codes(const float* x, uint8_t* codes) {
  constexpr int kOffset = 1 << (kBits - 1);  // code of 0: 8 or 16
  constexpr int kTop = (1 << kBits) - 1;
  const float d = largest_magnitude(x) / -kOffset;
  const float inverse = inverse_or_zero(d);
  for (int j = 0; j < kBlock; ++j) {
    // -(the value of largest magnitude) would be code 2^bits, one past the top: it takes the top.
    const int code = low_byte_signed(x[j] * inverse + (kOffset + 0.5f));
    codes[j] = static_cast<uint8_t>(code < kTop ? code : kTop);
  }
  return d;
}

// Q4_1 / Q5_1's codes of one block; sets d and the minimum in fp32. The minimum and maximum
// skip NaNs (an all-NaN block keeps the starting -FLT_MAX / FLT_MAX, as ggml's does).
// Q4_1 clamps with min(15, (int8_t)...), Q5_1 casts to (uint8_t) unclamped: the same codes, as
// (x - min) / d + 0.5 stays in [0, 2^bits) or truncates to INT32_MIN (low byte 0).
template <int kBits>
void asymmetric_codes(const float* x, uint8_t* codes, float& d, float& min) {
  constexpr int kTop = (1 << kBits) - 1;
  min = std::numeric_limits<float>::max();
  float max = -std::numeric_limits<float>::max();
  for (int j = 0; j < kBlock; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  d = (max - min) / kTop;
  const float inverse = inverse_or_zero(d);
  for (int j = 0; j < kBlock; ++j) {
    const int code = low_byte_signed((x[j] - min) * inverse + 0.5f);
    codes[j] = static_cast<uint8_t>(code < kTop ? code : kTop);
  }
}

// Codes 0..15 (the low four bits of 5-bit codes) into qs: byte j = element j | element j + 16 << 4.
void pack_nibbles(const uint8_t* codes, uint8_t* qs) {
  for (int j = 0; j < kHalfBlock; ++j) qs[j] = static_cast<uint8_t>((codes[j] & 0x0F) | ((codes[j + kHalfBlock] & 0x0F) << 4));
}

// The fifth bit of each code into qh, little-endian: bit j of the 32-bit word for element j.
void pack_fifth_bits(const uint8_t* codes, uint8_t* qh) {
  uint32_t bits = 0;
  for (int j = 0; j < kBlock; ++j) bits |= static_cast<uint32_t>((codes[j] >> 4) & 1) << j;
  for (int byte = 0; byte < 4; ++byte) qh[byte] = static_cast<uint8_t>(bits >> (8 * byte));
}

// pack_nibbles and pack_fifth_bits' inverse (qh null for the 4-bit types).
void unpack_codes(const uint8_t* qs, const uint8_t* qh, int* codes) {
  uint32_t fifth_bits = 0;
  if (qh != nullptr) {
    for (int byte = 0; byte < 4; ++byte) fifth_bits |= static_cast<uint32_t>(qh[byte]) << (8 * byte);
  }
  for (int j = 0; j < kHalfBlock; ++j) {
    codes[j] = (qs[j] & 0x0F) | static_cast<int>(((fifth_bits >> j) & 1) << 4);
    codes[j + kHalfBlock] = (qs[j] >> 4) | static_cast<int>(((fifth_bits >> (j + kHalfBlock)) & 1) << 4);
  }
}

// value = (code - 2^(bits-1)) * d, the symmetric types' dequantization.
template <int kBits>
void expand_symmetric(const int* codes, uint16_t d_bits, float* y) {
  constexpr int kOffset = 1 << (kBits - 1);
  const float d = float_from_fp16_bits(d_bits);
  for (int j = 0; j < kBlock; ++j) y[j] = static_cast<float>(codes[j] - kOffset) * d;
}

// value = code * d + m, the asymmetric types' dequantization (code * d is exact: 5 bits times 11).
void expand_asymmetric(const int* codes, uint16_t d_bits, uint16_t m_bits, float* y) {
  const float d = float_from_fp16_bits(d_bits);
  const float m = float_from_fp16_bits(m_bits);
  for (int j = 0; j < kBlock; ++j) y[j] = static_cast<float>(codes[j]) * d + m;
}

// n / 32 blocks of a 4- or 5-bit type: each block's codes with d (and, asymmetric, the min m),
// the low four bits as nibbles and the 5-bit types' fifth bits in qh.
template <typename Block, int kBits, bool kAsymmetric>
void quantize_legacy(const float* x, uint8_t* out, int64_t n) {
  quantize_blocks<Block, kBlock>(x, out, n, [](const float* values, Block& block) {
    uint8_t codes[kBlock];
    if constexpr (kAsymmetric) {
      float d, min;
      asymmetric_codes<kBits>(values, codes, d, min);
      block.d = fp16_bits_from_float(d);
      block.m = fp16_bits_from_float(min);
    } else {
      block.d = fp16_bits_from_float(symmetric_codes<kBits>(values, codes));
    }
    pack_nibbles(codes, block.qs);
    if constexpr (kBits == 5) pack_fifth_bits(codes, block.qh);
  });
}

}  // namespace

void quantize_q4_0(const float* x, uint8_t* out, int64_t n) { quantize_legacy<GgufBlockQ4_0, 4, false>(x, out, n); }
void quantize_q5_0(const float* x, uint8_t* out, int64_t n) { quantize_legacy<BlockQ5_0, 5, false>(x, out, n); }
void quantize_q4_1(const float* x, uint8_t* out, int64_t n) { quantize_legacy<BlockQ4_1, 4, true>(x, out, n); }
void quantize_q5_1(const float* x, uint8_t* out, int64_t n) { quantize_legacy<BlockQ5_1, 5, true>(x, out, n); }

void quantize_q8_0(const float* x, uint8_t* out, int64_t n) {
  quantize_blocks<GgufBlockQ8_0, kBlock>(x, out, n, [](const float* values, GgufBlockQ8_0& block) {
    // ggml's MAX(a, b) is a > b ? a : b: a NaN takes the running maximum's place until the next
    // element replaces it.
    float largest = 0.0f;
    for (int j = 0; j < kBlock; ++j) largest = largest > std::fabs(values[j]) ? largest : std::fabs(values[j]);
    const float d = largest / 127;
    const float inverse = inverse_or_zero(d);
    block.d = fp16_bits_from_float(d);
    for (int j = 0; j < kBlock; ++j) block.qs[j] = static_cast<int8_t>(low_byte_signed(std::round(values[j] * inverse)));
  });
}

void dequantize_q4_0(const uint8_t* in, float* y, int64_t n) {
  dequantize_blocks<GgufBlockQ4_0, kBlock>(in, y, n, [](const GgufBlockQ4_0& block, float* values) {
    int codes[kBlock];
    unpack_codes(block.qs, nullptr, codes);
    expand_symmetric<4>(codes, block.d, values);
  });
}

void dequantize_q5_0(const uint8_t* in, float* y, int64_t n) {
  dequantize_blocks<BlockQ5_0, kBlock>(in, y, n, [](const BlockQ5_0& block, float* values) {
    int codes[kBlock];
    unpack_codes(block.qs, block.qh, codes);
    expand_symmetric<5>(codes, block.d, values);
  });
}

void dequantize_q4_1(const uint8_t* in, float* y, int64_t n) {
  dequantize_blocks<BlockQ4_1, kBlock>(in, y, n, [](const BlockQ4_1& block, float* values) {
    int codes[kBlock];
    unpack_codes(block.qs, nullptr, codes);
    expand_asymmetric(codes, block.d, block.m, values);
  });
}

void dequantize_q5_1(const uint8_t* in, float* y, int64_t n) {
  dequantize_blocks<BlockQ5_1, kBlock>(in, y, n, [](const BlockQ5_1& block, float* values) {
    int codes[kBlock];
    unpack_codes(block.qs, block.qh, codes);
    expand_asymmetric(codes, block.d, block.m, values);
  });
}

void dequantize_q8_0(const uint8_t* in, float* y, int64_t n) {
  dequantize_blocks<GgufBlockQ8_0, kBlock>(in, y, n, [](const GgufBlockQ8_0& block, float* values) {
    const float d = float_from_fp16_bits(block.d);
    for (int j = 0; j < kBlock; ++j) values[j] = static_cast<float>(block.qs[j]) * d;
  });
}

}  // namespace qtrain::qat::gguf_quants
QTRAIN_GGML_ROUNDING_END
