// llama.cpp's K-quants (Q2_K .. Q6_K): super-blocks of 256 values in sub-blocks of 16 or 32, each
// sub-block with its own small integer scale (and, for Q2_K, Q4_K and Q5_K, a min), those scales
// quantized again against one fp16 d (and dmin) per super-block.
//
// Bit for bit with ggml (ggml/src/ggml-quants.c, quantize_row_q*_K_ref and dequantize_row_q*_K):
// llama-quantize without an importance matrix runs exactly these. Exactness rests on three
// things, kept here on purpose:
//   - every float expression is evaluated in ggml's order, one rounding per operation (no fused
//     multiply-add: see the pragma below);
//   - rounding to an integer is ggml's trick (round half to even through a float add), not
//     std::lround (round half away from zero);
//   - fp32 -> fp16 rounds to nearest even, NaN -> a quiet NaN, as ggml's conversion does
//     (qat/gguf_fp16.h).
// Sub-blocks whose requantized scale is zero keep the codes of the first fit, as ggml's do.
#include <cmath>
#include <cstring>

#include "qat/ggml_rounding.h"
#include "qat/gguf_fp16.h"
#include "qat/gguf_quant_blocks.h"
#include "qat/gguf_quants.h"

QTRAIN_GGML_ROUNDING_BEGIN  // ggml's roundings, no contraction (qat/ggml_rounding.h)

namespace qtrain::qat::gguf_quants {

namespace {

constexpr int kSubBlock16 = 16;  // Q2_K, Q3_K, Q6_K: 16 sub-blocks of 16
constexpr int kSubBlock32 = 32;  // Q4_K, Q5_K: 8 sub-blocks of 32
constexpr int kSubBlocksOf16 = kSuperBlock / kSubBlock16;
constexpr int kSubBlocksOf32 = kSuperBlock / kSubBlock32;

// A fit whose largest |x| is below this is all zeros (ggml's GROUP_MAX_EPS).
constexpr float kAllZero = 1e-15f;

// ggml-common.h's super-block structs. Every fp16 (d, dmin) is kept as its bits; the bytes are
// little-endian, as on the hosts qtrain runs on.
struct BlockQ2_K {
  uint8_t scales[kSubBlocksOf16];  // sub-block j: scale code (low nibble), min code (high)
  uint8_t qs[kSuperBlock / 4];     // 2-bit codes; see pack_2bit
  uint16_t d;
  uint16_t dmin;
};
static_assert(sizeof(BlockQ2_K) == kQ2_KBytes, "wrong q2_K block size/padding");

struct BlockQ3_K {
  uint8_t hmask[kSuperBlock / 8];  // third bit of element e: byte e % 32, bit e / 32
  uint8_t qs[kSuperBlock / 4];     // low 2 bits; see pack_2bit
  uint8_t scales[12];              // 16 6-bit scale codes; see q3_k_scale_code
  uint16_t d;
};
static_assert(sizeof(BlockQ3_K) == kQ3_KBytes, "wrong q3_K block size/padding");

struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];           // 8 6-bit scale and 8 6-bit min codes; see pack_scale_min
  uint8_t qs[kSuperBlock / 2];  // 4-bit codes: byte 32c + l holds element 64c + l (low), 64c + 32 + l (high)
};
static_assert(sizeof(BlockQ4_K) == kQ4_KBytes, "wrong q4_K block size/padding");

struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];           // as Q4_K's
  uint8_t qh[kSuperBlock / 8];  // fifth bit of element 64c + l (l < 32): byte l, bit 2c; of 64c + 32 + l: bit 2c + 1
  uint8_t qs[kSuperBlock / 2];  // low 4 bits, laid out as Q4_K's
};
static_assert(sizeof(BlockQ5_K) == kQ5_KBytes, "wrong q5_K block size/padding");

struct BlockQ6_K {
  uint8_t ql[kSuperBlock / 2];       // low 4 bits; see q6_k_code
  uint8_t qh[kSuperBlock / 4];       // high 2 bits
  int8_t scales[kSubBlocksOf16];     // signed 8-bit scale codes
  uint16_t d;
};
static_assert(sizeof(BlockQ6_K) == kQ6_KBytes, "wrong q6_K block size/padding");

// Round to the nearest integer, halves to even: adding 1.5 * 2^23 leaves the rounded value in the
// low mantissa bits. ggml's rounding for every code and scale code; exact for |value| < 2^22, and
// beyond that the same bits as ggml's.
int round_to_int(float value) {
  const float shifted = value + 12582912.f;
  uint32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  return static_cast<int>(bits & 0x007fffffu) - 0x00400000;
}

int clamp_int(int value, int low, int high) { return value < low ? low : (value > high ? high : value); }

// The signed x of largest |x| in x[0, n) (the first of ties; 0 when all are 0), that |x| in *abs_max.
float signed_abs_max(const float* x, int n, float* abs_max) {
  float max = 0;
  *abs_max = 0;
  for (int i = 0; i < n; ++i) {
    const float magnitude = std::fabs(x[i]);
    if (magnitude > *abs_max) {
      *abs_max = magnitude;
      max = x[i];
    }
  }
  return max;
}

// The codes of x at inverse scale `inverse` on [-nmax, nmax - 1], written as q + offset when
// `out` is given, and their x^2-weighted sums sum w x q and sum w q^2 (w = x^2), added in ggml's
// order.
void weighted_codes(const float* x, int n, float inverse, int nmax, int offset, int8_t* out, float* sum_xq, float* sum_qq) {
  *sum_xq = 0;
  *sum_qq = 0;
  for (int i = 0; i < n; ++i) {
    const int q = clamp_int(round_to_int(inverse * x[i]), -nmax, nmax - 1);
    if (out) out[i] = static_cast<int8_t>(q + offset);
    const float w = x[i] * x[i];
    *sum_xq += w * x[i] * q;
    *sum_qq += w * q * q;
  }
}

// Q6_K's sub-block fit (ggml's make_qx_quants, x^2-weighted): codes q in [-nmax, nmax - 1] and a
// scale d minimising sum x^2 (x - d q)^2. Tries the grid of -max / (nmax + 0.1 k), k = 0, +-1 .. +-9,
// each with its least-squares d; writes q + nmax into `codes` and returns d.
float fit_symmetric_scale(const float* x, int n, int nmax, int8_t* codes) {
  float abs_max;
  const float max = signed_abs_max(x, n, &abs_max);
  if (abs_max < kAllZero) {
    std::memset(codes, 0, n);
    return 0.f;
  }
  auto weighted_sums = [&](float inverse, float* sum_xq, float* sum_qq, int8_t* out) {
    weighted_codes(x, n, inverse, nmax, /*offset=*/nmax, out, sum_xq, sum_qq);
  };
  float sum_xq;
  float sum_qq;
  weighted_sums(-nmax / max, &sum_xq, &sum_qq, codes);
  float scale = sum_qq ? sum_xq / sum_qq : 0.0f;
  float best = scale * sum_xq;  // the weighted error's reduction; larger is better
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) {
      continue;
    }
    const float inverse = -(nmax + 0.1f * step) / max;
    weighted_sums(inverse, &sum_xq, &sum_qq, nullptr);
    if (sum_qq > 0 && sum_xq * sum_xq > best * sum_qq) {
      weighted_sums(inverse, &sum_xq, &sum_qq, codes);
      scale = sum_xq / sum_qq;
      best = scale * sum_xq;
    }
  }
  return scale;
}

// Q3_K's sub-block fit (ggml's make_q3_quants with rmse): codes q in [-nmax, nmax - 1] from
// -max / nmax, then up to 5 passes of coordinate descent, each code moved to its own optimum
// under the least-squares scale of the others when that lowers the x^2-weighted error. Writes
// q + nmax into `codes` (0 for an all-zero group) and returns the least-squares scale.
float fit_symmetric_scale_iterated(const float* x, int n, int nmax, int8_t* codes) {
  float abs_max;
  const float max = signed_abs_max(x, n, &abs_max);
  if (abs_max < kAllZero) {
    std::memset(codes, 0, n);
    return 0.f;
  }
  float sum_xq;
  float sum_qq;
  weighted_codes(x, n, -nmax / max, nmax, /*offset=*/0, codes, &sum_xq, &sum_qq);
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      // The sums without element i, and i's best code under their scale.
      float others_xq = sum_xq - w * x[i] * codes[i];
      if (others_xq > 0) {
        float others_qq = sum_qq - w * codes[i] * codes[i];
        const int q = clamp_int(round_to_int(x[i] * others_qq / others_xq), -nmax, nmax - 1);
        if (q != codes[i]) {
          others_xq += w * x[i] * q;
          others_qq += w * q * q;
          // sum_xq^2 / sum_qq is the error's reduction; keep the move if it grows.
          if (others_qq > 0 && others_xq * others_xq * sum_qq > sum_xq * sum_xq * others_qq) {
            codes[i] = static_cast<int8_t>(q);
            sum_xq = others_xq;
            sum_qq = others_qq;
            ++changed;
          }
        }
      }
    }
    if (!changed) {
      break;
    }
  }
  for (int i = 0; i < n; ++i) {
    codes[i] = static_cast<int8_t>(codes[i] + nmax);
  }
  return sum_qq > 0.0f ? sum_xq / sum_qq : 0.0f;
}

// The search of fit_scale_and_min, one row per type.
struct ScaleMinSearch {
  int nmax;             // codes in [0, nmax]
  float first_offset;   // candidate k has inverse scale (nmax + first_offset + step * k) / (max - min)
  float step;
  int steps;            // k = 0 .. steps
  bool absolute_error;  // minimise sum w |err| (Q2_K) rather than sum w err^2
};

constexpr ScaleMinSearch kQ2_KSearch{/*nmax=*/3, /*first_offset=*/-0.5f, /*step=*/0.1f, /*steps=*/15, /*absolute_error=*/true};
constexpr ScaleMinSearch kQ4_KSearch{/*nmax=*/15, /*first_offset=*/-1.f, /*step=*/0.1f, /*steps=*/20, /*absolute_error=*/false};
constexpr ScaleMinSearch kQ5_KSearch{/*nmax=*/31, /*first_offset=*/-0.5f, /*step=*/0.1f, /*steps=*/15, /*absolute_error=*/false};

// An asymmetric sub-block fit (ggml's make_qkx2_quants): x ~ scale * q - min_out with codes q in
// [0, nmax], min_out >= 0. Starts from the range [min(x, 0), max(x)]; for each candidate inverse
// scale, rounds the codes and solves the weighted least squares for scale and offset (offset
// clamped to <= 0), keeping the candidate with the smallest weighted error. Writes the codes and
// *min_out (the negated offset) and returns the scale.
float fit_scale_and_min(const float* x, const float* weights, int n, const ScaleMinSearch& search, uint8_t* codes,
                        float* min_out) {
  float min = x[0];
  float max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::memset(codes, 0, n);
    *min_out = -min;
    return 0.f;
  }
  const int nmax = search.nmax;
  auto weighted_error = [&](float scale, float offset, const uint8_t* q) {
    float error = 0;
    for (int i = 0; i < n; ++i) {
      float diff = scale * q[i] + offset - x[i];
      diff = search.absolute_error ? std::fabs(diff) : diff * diff;
      error += weights[i] * diff;
    }
    return error;
  };
  float inverse = nmax / (max - min);
  float scale = 1 / inverse;
  for (int i = 0; i < n; ++i) {
    codes[i] = static_cast<uint8_t>(clamp_int(round_to_int(inverse * (x[i] - min)), 0, nmax));
  }
  float best_error = weighted_error(scale, min, codes);
  uint8_t candidate[kSubBlock32];
  for (int k = 0; k <= search.steps; ++k) {
    inverse = (search.first_offset + search.step * k + nmax) / (max - min);
    float sum_q = 0;
    float sum_qq = 0;
    float sum_xq = 0;
    for (int i = 0; i < n; ++i) {
      const int q = clamp_int(round_to_int(inverse * (x[i] - min)), 0, nmax);
      candidate[i] = static_cast<uint8_t>(q);
      const float w = weights[i];
      sum_q += w * q;
      sum_qq += w * q * q;
      sum_xq += w * q * x[i];
    }
    // Normal equations of min over (scale, offset) of sum w (scale q + offset - x)^2.
    const float determinant = sum_w * sum_qq - sum_q * sum_q;
    if (determinant > 0) {
      float this_scale = (sum_w * sum_xq - sum_x * sum_q) / determinant;
      float this_offset = (sum_qq * sum_x - sum_q * sum_xq) / determinant;
      if (this_offset > 0) {
        this_offset = 0;
        this_scale = sum_xq / sum_qq;
      }
      const float error = weighted_error(this_scale, this_offset, candidate);
      if (error < best_error) {
        std::memcpy(codes, candidate, n);
        best_error = error;
        scale = this_scale;
        min = this_offset;
      }
    }
  }
  *min_out = -min;
  return scale;
}

// Q2_K and Q3_K's 2-bit layout: byte 32c + l holds elements 128c + l + 32s at bits 2s (s = 0..3).
void pack_2bit(const uint8_t* codes, uint8_t* qs) {
  for (int chunk = 0; chunk < kSuperBlock; chunk += 128) {
    for (int l = 0; l < 32; ++l) {
      qs[chunk / 4 + l] = static_cast<uint8_t>(codes[chunk + l] | (codes[chunk + l + 32] << 2) |
                                               (codes[chunk + l + 64] << 4) | (codes[chunk + l + 96] << 6));
    }
  }
}

int unpack_2bit(const uint8_t* qs, int element) {
  const int chunk = element / 128;
  const int within = element % 128;
  return (qs[32 * chunk + within % 32] >> (2 * (within / 32))) & 3;
}

// Q4_K and Q5_K's 12 scale bytes: 8 6-bit scale codes and 8 6-bit min codes. Sub-blocks 0-3 take
// bytes 0-3 (scale) and 4-7 (min) whole; sub-blocks 4-7 put their low nibbles in bytes 8-11
// (scale low, min high) and their top two bits in the top bits of bytes 0-3 (scale) and 4-7 (min).
void pack_scale_min(const uint8_t* scale_codes, const uint8_t* min_codes, uint8_t* packed) {
  for (int j = 0; j < kSubBlocksOf32; ++j) {
    const int scale = scale_codes[j];
    const int min = min_codes[j];
    if (j < 4) {
      packed[j] = static_cast<uint8_t>(scale);
      packed[j + 4] = static_cast<uint8_t>(min);
    } else {
      packed[j + 4] = static_cast<uint8_t>((scale & 0xF) | ((min & 0xF) << 4));
      packed[j - 4] = static_cast<uint8_t>(packed[j - 4] | ((scale >> 4) << 6));
      packed[j] = static_cast<uint8_t>(packed[j] | ((min >> 4) << 6));
    }
  }
}

void unpack_scale_min(const uint8_t* packed, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = packed[j] & 63;
    *min = packed[j + 4] & 63;
  } else {
    *scale = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4);
    *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// Sub-block j's scale and min as Q4_K / Q5_K dequantize: d · its scale code, dmin · its min code.
struct SubBlockScaleMin {
  float scale;
  float min;
};
template <class Block>
SubBlockScaleMin sub_block_scale_min(const Block& block, int j) {
  int scale_code;
  int min_code;
  unpack_scale_min(block.scales, j, &scale_code, &min_code);
  return {float_from_fp16_bits(block.d) * scale_code, float_from_fp16_bits(block.dmin) * min_code};
}

// Q4_K / Q5_K's four low bits of element e: byte 32 · (e / 64) + e % 32, its low nibble for the
// first 32 elements of each 64, its high nibble for the next 32.
int low_nibble_code(const uint8_t* qs, int e) {
  const uint8_t byte = qs[32 * (e / 64) + e % 32];
  return (e % 64) < 32 ? byte & 0xF : byte >> 4;
}

// Q3_K's 12 scale bytes: 16 6-bit codes (the signed scale + 32). Low nibbles: sub-blocks 0-7 in
// the low nibble of bytes 0-7, 8-15 in their high nibble; top two bits of sub-block j in byte
// 8 + j % 4 at bits 2 (j / 4).
int q3_k_scale_code(const uint8_t* packed, int j) {
  const int low = j < 8 ? packed[j] & 0xF : packed[j - 8] >> 4;
  const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
  return low | (high << 4);
}

// The weights of Q4_K and Q5_K's fits: the sub-block's rms plus |x|.
void rms_plus_abs_weights(const float* x, float* weights) {
  float sum_x2 = 0;
  for (int l = 0; l < kSubBlock32; ++l) sum_x2 += x[l] * x[l];
  const float rms = std::sqrt(sum_x2 / kSubBlock32);
  for (int l = 0; l < kSubBlock32; ++l) weights[l] = rms + std::fabs(x[l]);
}

// Q4_K and Q5_K share everything but the code width: fit each sub-block of 32, quantize the scales
// and mins to 6 bits against d = max scale / 63 and dmin = max min / 63, then requantize every
// sub-block whose scale code is not zero with the stored (fp16-rounded) d * scale and dmin * min.
// Writes the header (d, dmin, scales) of `block` and the codes.
template <typename Block>
void quantize_scale_min_super_block(const float* x, const ScaleMinSearch& search, Block& block, uint8_t* codes) {
  float scales[kSubBlocksOf32];
  float mins[kSubBlocksOf32];
  float max_scale = 0;  // scales and mins are positive: the min is subtracted
  float max_min = 0;
  for (int j = 0; j < kSubBlocksOf32; ++j) {
    float weights[kSubBlock32];
    rms_plus_abs_weights(x + kSubBlock32 * j, weights);
    scales[j] = fit_scale_and_min(x + kSubBlock32 * j, weights, kSubBlock32, search, codes + kSubBlock32 * j, &mins[j]);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inverse_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inverse_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t scale_codes[kSubBlocksOf32];
  uint8_t min_codes[kSubBlocksOf32];
  for (int j = 0; j < kSubBlocksOf32; ++j) {
    // ggml stores the rounded value in a byte before clamping: a negative one wraps, then clamps to 63.
    const auto scale_code = static_cast<uint8_t>(round_to_int(inverse_scale * scales[j]));
    const auto min_code = static_cast<uint8_t>(round_to_int(inverse_min * mins[j]));
    scale_codes[j] = scale_code < 63 ? scale_code : 63;
    min_codes[j] = min_code < 63 ? min_code : 63;
  }
  pack_scale_min(scale_codes, min_codes, block.scales);
  block.d = fp16_bits_from_float(max_scale / 63.f);
  block.dmin = fp16_bits_from_float(max_min / 63.f);

  for (int j = 0; j < kSubBlocksOf32; ++j) {
    const auto [d, dm] = sub_block_scale_min(block, j);
    if (!d) continue;
    for (int l = 0; l < kSubBlock32; ++l) {
      const int q = round_to_int((x[kSubBlock32 * j + l] + dm) / d);
      codes[kSubBlock32 * j + l] = static_cast<uint8_t>(clamp_int(q, 0, search.nmax));
    }
  }
}

void quantize_super_block_q2_k(const float* x, BlockQ2_K& block) {
  constexpr float kMaxScaleCode = 15.f;  // scale and min codes are 4 bits
  uint8_t codes[kSuperBlock];
  float scales[kSubBlocksOf16];
  float mins[kSubBlocksOf16];
  float max_scale = 0;  // scales and mins are positive: the min is subtracted
  float max_min = 0;
  for (int j = 0; j < kSubBlocksOf16; ++j) {
    float weights[kSubBlock16];
    for (int l = 0; l < kSubBlock16; ++l) weights[l] = std::fabs(x[kSubBlock16 * j + l]);
    scales[j] = fit_scale_and_min(x + kSubBlock16 * j, weights, kSubBlock16, kQ2_KSearch, codes + kSubBlock16 * j, &mins[j]);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }

  // Scale codes in the low nibbles, min codes in the high; ggml stores the rounded scale whole (a
  // negative one wraps to a byte) and ORs the min in, unclamped.
  if (max_scale > 0) {
    const float inverse = kMaxScaleCode / max_scale;
    for (int j = 0; j < kSubBlocksOf16; ++j) {
      block.scales[j] = static_cast<uint8_t>(round_to_int(inverse * scales[j]));
    }
    block.d = fp16_bits_from_float(max_scale / kMaxScaleCode);
  } else {
    std::memset(block.scales, 0, sizeof(block.scales));
    block.d = fp16_bits_from_float(0.f);
  }
  if (max_min > 0) {
    const float inverse = kMaxScaleCode / max_min;
    for (int j = 0; j < kSubBlocksOf16; ++j) {
      const auto min_code = static_cast<uint32_t>(round_to_int(inverse * mins[j]));
      block.scales[j] = static_cast<uint8_t>(block.scales[j] | (min_code << 4));
    }
    block.dmin = fp16_bits_from_float(max_min / kMaxScaleCode);
  } else {
    block.dmin = fp16_bits_from_float(0.f);
  }

  // Requantize with the stored d * scale code and dmin * min code.
  for (int j = 0; j < kSubBlocksOf16; ++j) {
    const float d = float_from_fp16_bits(block.d) * (block.scales[j] & 0xF);
    if (!d) continue;
    const float dm = float_from_fp16_bits(block.dmin) * (block.scales[j] >> 4);
    for (int l = 0; l < kSubBlock16; ++l) {
      const int q = round_to_int((x[kSubBlock16 * j + l] + dm) / d);
      codes[kSubBlock16 * j + l] = static_cast<uint8_t>(clamp_int(q, 0, 3));
    }
  }
  pack_2bit(codes, block.qs);
}

// Q3_K and Q6_K: a symmetric scale fitted to each sub-block of 16 (`fit` with codes in
// [-nmax, nmax - 1], writing the sub-block's first codes), and the signed scale of largest
// magnitude (the first of equals), whose stored fraction the sub-blocks' scale codes count in.
struct SubBlockScales {
  float scales[kSubBlocksOf16];
  float max_scale = 0;
  float abs_max_scale = 0;
};

using SymmetricFit = float (*)(const float* x, int n, int nmax, int8_t* codes);

SubBlockScales fit_sub_block_scales(const float* x, SymmetricFit fit, int nmax, int8_t* codes) {
  SubBlockScales fitted;
  for (int j = 0; j < kSubBlocksOf16; ++j) {
    fitted.scales[j] = fit(x + kSubBlock16 * j, kSubBlock16, nmax, codes + kSubBlock16 * j);
    const float magnitude = std::fabs(fitted.scales[j]);
    if (magnitude > fitted.abs_max_scale) {
      fitted.abs_max_scale = magnitude;
      fitted.max_scale = fitted.scales[j];
    }
  }
  return fitted;
}

// The codes again against each sub-block's stored scale `d_of(j)` (its fp16 d times its scale
// code): q = round(x / d) clamped to [-offset, offset - 1], written as q + offset. A zero scale
// keeps the sub-block's first codes.
template <typename Scale>
void requantize_sub_blocks(const float* x, int offset, Scale d_of, int8_t* codes) {
  for (int j = 0; j < kSubBlocksOf16; ++j) {
    const float d = d_of(j);
    if (!d) continue;
    for (int l = 0; l < kSubBlock16; ++l) {
      const int q = round_to_int(x[kSubBlock16 * j + l] / d);
      codes[kSubBlock16 * j + l] = static_cast<int8_t>(clamp_int(q, -offset, offset - 1) + offset);
    }
  }
}

void quantize_super_block_q3_k(const float* x, BlockQ3_K& block) {
  int8_t codes[kSuperBlock];  // q + 4, q in [-4, 3]
  const auto fitted = fit_sub_block_scales(x, fit_symmetric_scale_iterated, 4, codes);

  // 6-bit scale codes (signed code + 32) against d = max_scale / -32.
  std::memset(block.scales, 0, sizeof(block.scales));
  if (fitted.max_scale) {
    const float inverse = -32.f / fitted.max_scale;
    for (int j = 0; j < kSubBlocksOf16; ++j) {
      const auto signed_code = static_cast<int8_t>(round_to_int(inverse * fitted.scales[j]));
      const int code = clamp_int(signed_code, -32, 31) + 32;
      if (j < 8) {
        block.scales[j] = static_cast<uint8_t>(code & 0xF);
      } else {
        block.scales[j - 8] = static_cast<uint8_t>(block.scales[j - 8] | ((code & 0xF) << 4));
      }
      block.scales[8 + j % 4] = static_cast<uint8_t>(block.scales[8 + j % 4] | ((code >> 4) << (2 * (j / 4))));
    }
    block.d = fp16_bits_from_float(1 / inverse);
  } else {
    block.d = fp16_bits_from_float(0.f);
  }

  // Requantize with the stored d * (scale code - 32).
  requantize_sub_blocks(x, 4, [&](int j) { return float_from_fp16_bits(block.d) * (q3_k_scale_code(block.scales, j) - 32); },
                        codes);

  // The third bit into hmask (element e: byte e % 32, bit e / 32), the low two into qs.
  std::memset(block.hmask, 0, sizeof(block.hmask));
  uint8_t low_bits[kSuperBlock];
  for (int e = 0; e < kSuperBlock; ++e) {
    if (codes[e] > 3) {
      block.hmask[e % 32] = static_cast<uint8_t>(block.hmask[e % 32] | (1 << (e / 32)));
    }
    low_bits[e] = static_cast<uint8_t>(codes[e] & 3);
  }
  pack_2bit(low_bits, block.qs);
}

void quantize_super_block_q4_k(const float* x, BlockQ4_K& block) {
  uint8_t codes[kSuperBlock];
  quantize_scale_min_super_block(x, kQ4_KSearch, block, codes);
  for (int chunk = 0; chunk < kSuperBlock / 64; ++chunk) {
    for (int l = 0; l < 32; ++l) {
      block.qs[32 * chunk + l] = static_cast<uint8_t>(codes[64 * chunk + l] | (codes[64 * chunk + 32 + l] << 4));
    }
  }
}

void quantize_super_block_q5_k(const float* x, BlockQ5_K& block) {
  uint8_t codes[kSuperBlock];
  quantize_scale_min_super_block(x, kQ5_KSearch, block, codes);
  std::memset(block.qh, 0, sizeof(block.qh));
  for (int chunk = 0; chunk < kSuperBlock / 64; ++chunk) {
    for (int l = 0; l < 32; ++l) {
      const int first = codes[64 * chunk + l];
      const int second = codes[64 * chunk + 32 + l];
      block.qs[32 * chunk + l] = static_cast<uint8_t>((first & 0xF) | ((second & 0xF) << 4));
      block.qh[l] = static_cast<uint8_t>(block.qh[l] | ((first >> 4) << (2 * chunk)) | ((second >> 4) << (2 * chunk + 1)));
    }
  }
}

void quantize_super_block_q6_k(const float* x, BlockQ6_K& block) {
  int8_t codes[kSuperBlock];  // q + 32, q in [-32, 31]
  const auto fitted = fit_sub_block_scales(x, fit_symmetric_scale, 32, codes);
  if (fitted.abs_max_scale < kAllZero) {
    std::memset(&block, 0, sizeof(block));
    return;
  }

  // Signed 8-bit scale codes against d = max_scale / -128.
  const float inverse = -128.f / fitted.max_scale;
  block.d = fp16_bits_from_float(1 / inverse);
  for (int j = 0; j < kSubBlocksOf16; ++j) {
    const int code = round_to_int(inverse * fitted.scales[j]);
    block.scales[j] = static_cast<int8_t>(code < 127 ? code : 127);
  }

  // Requantize with the stored d * scale code.
  requantize_sub_blocks(x, 32, [&](int j) { return float_from_fp16_bits(block.d) * block.scales[j]; }, codes);

  // Per chunk of 128: ql byte l holds elements l (low) and 64 + l (high), byte 32 + l elements
  // 32 + l and 96 + l; qh byte l holds the top two bits of elements l + 32s at bits 2s.
  for (int chunk = 0; chunk < kSuperBlock / 128; ++chunk) {
    const int8_t* q = codes + 128 * chunk;
    uint8_t* ql = block.ql + 64 * chunk;
    uint8_t* qh = block.qh + 32 * chunk;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((q[l] & 0xF) | ((q[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((q[l + 32] & 0xF) | ((q[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) | ((q[l + 96] >> 4) << 6));
    }
  }
}

// Q6_K's code of element e (within its super-block), in [-32, 31].
int q6_k_code(const BlockQ6_K& block, int e) {
  const int chunk = e / 128;
  const int within = e % 128;
  const int l = within % 32;
  const int quarter = within / 32;  // 0: ql[l] low, 1: ql[l + 32] low, 2: ql[l] high, 3: ql[l + 32] high
  const uint8_t low_byte = block.ql[64 * chunk + l + 32 * (quarter % 2)];
  const int low = quarter < 2 ? low_byte & 0xF : low_byte >> 4;
  const int high = (block.qh[32 * chunk + l] >> (2 * quarter)) & 3;
  return (low | (high << 4)) - 32;
}

// Dequantizes n / 256 super-blocks: `value(block, e)` is element e of a super-block.
template <typename Block, typename Value>
void dequantize_elements(const uint8_t* in, float* y, int64_t n, Value value) {
  dequantize_blocks<Block, kSuperBlock>(in, y, n, [&](const Block& block, float* values) {
    for (int e = 0; e < kSuperBlock; ++e) values[e] = value(block, e);
  });
}

}  // namespace

void quantize_q2_k(const float* x, uint8_t* out, int64_t n) { quantize_blocks<BlockQ2_K, kSuperBlock>(x, out, n, quantize_super_block_q2_k); }
void quantize_q3_k(const float* x, uint8_t* out, int64_t n) { quantize_blocks<BlockQ3_K, kSuperBlock>(x, out, n, quantize_super_block_q3_k); }
void quantize_q4_k(const float* x, uint8_t* out, int64_t n) { quantize_blocks<BlockQ4_K, kSuperBlock>(x, out, n, quantize_super_block_q4_k); }
void quantize_q5_k(const float* x, uint8_t* out, int64_t n) { quantize_blocks<BlockQ5_K, kSuperBlock>(x, out, n, quantize_super_block_q5_k); }
void quantize_q6_k(const float* x, uint8_t* out, int64_t n) { quantize_blocks<BlockQ6_K, kSuperBlock>(x, out, n, quantize_super_block_q6_k); }

// Each value as ggml computes it: (d * scale code) * q - (dmin * min code), in that order.

void dequantize_q2_k(const uint8_t* in, float* y, int64_t n) {
  dequantize_elements<BlockQ2_K>(in, y, n, [](const BlockQ2_K& block, int e) {
    const uint8_t scale_min = block.scales[e / kSubBlock16];
    const float d = float_from_fp16_bits(block.d) * (scale_min & 0xF);
    const float m = float_from_fp16_bits(block.dmin) * (scale_min >> 4);
    return d * unpack_2bit(block.qs, e) - m;
  });
}

void dequantize_q3_k(const uint8_t* in, float* y, int64_t n) {
  dequantize_elements<BlockQ3_K>(in, y, n, [](const BlockQ3_K& block, int e) {
    const float d = float_from_fp16_bits(block.d) * (q3_k_scale_code(block.scales, e / kSubBlock16) - 32);
    const int high_bit_set = (block.hmask[e % 32] >> (e / 32)) & 1;
    return d * (unpack_2bit(block.qs, e) - (high_bit_set ? 0 : 4));
  });
}

void dequantize_q4_k(const uint8_t* in, float* y, int64_t n) {
  dequantize_elements<BlockQ4_K>(in, y, n, [](const BlockQ4_K& block, int e) {
    const auto [d, m] = sub_block_scale_min(block, e / kSubBlock32);
    return d * low_nibble_code(block.qs, e) - m;
  });
}

void dequantize_q5_k(const uint8_t* in, float* y, int64_t n) {
  dequantize_elements<BlockQ5_K>(in, y, n, [](const BlockQ5_K& block, int e) {
    const auto [d, m] = sub_block_scale_min(block, e / kSubBlock32);
    // The fifth bit: qh[e % 32], bit 2 · (e / 64) for the first 32 of each 64, the next bit after.
    const int high = (block.qh[e % 32] >> (2 * (e / 64) + ((e % 64) >= 32 ? 1 : 0))) & 1;
    return d * (low_nibble_code(block.qs, e) + (high ? 16 : 0)) - m;
  });
}

void dequantize_q6_k(const uint8_t* in, float* y, int64_t n) {
  dequantize_elements<BlockQ6_K>(in, y, n, [](const BlockQ6_K& block, int e) {
    const float d = float_from_fp16_bits(block.d) * block.scales[e / kSubBlock16];
    return d * q6_k_code(block, e);
  });
}

}  // namespace qtrain::qat::gguf_quants
QTRAIN_GGML_ROUNDING_END
