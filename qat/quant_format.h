#pragma once
// The grids a QAT quantizer can round onto, as data, named once (STYLE.md rule 6). A quantizer
// spec (quant_spec.h) names one of these; the numerics (quantize.h) read the grid from here.
//
//   int        affine integer grid of 2..8 bits (range and zero point: quant_spec.h)
//   fp8_e4m3   OCP FP8 E4M3 ("e4m3fn": no infinities), max 448, torch::kFloat8_e4m3fn's values
//   fp8_e5m2   OCP FP8 E5M2, max 57344, torch::kFloat8_e5m2's finite values
//   fp4_e2m1   OCP FP4 E2M1 (the elements of MXFP4 / NVFP4): 0, 0.5, 1, 1.5, 2, 3, 4, 6
//   nf4, fp4   bitsandbytes' 4-bit tables (four_bit_format.h), in [-1, 1]
//   gguf       llama.cpp's block types (Q4_K, Q6_K, Q5_0, ...: QuantSpec::gguf_block), each with its
//              own codes and levels of scales, rounded onto by qat/gguf_grid.h (weights only)
//
// The OCP minifloats are described by their bit fields; their values are every sign, exponent
// and mantissa combination up to `max_value`, with subnormals (exponent field 0: mantissa *
// 2^(1 - bias - mantissa_bits)). Rounding onto them is to nearest, ties to even mantissa, and
// saturates at +-max_value.
#include <cstdint>
#include <string>
#include <vector>

#include "qat/four_bit_type.h"

namespace qtrain::qat {

enum class QuantFormat { kInt, kFp8E4m3, kFp8E5m2, kFp4E2m1, kNf4, kFp4, kGguf };

enum class GridKind {
  kInteger,    // q in [quant_min, quant_max], affine
  kMinifloat,  // sign + exponent + mantissa bit fields
  kTable,      // bitsandbytes' 16-entry tables, codes chosen by bnb's pivots
  kGgufBlocks, // llama.cpp's block types: their codes and scales are qat/gguf_grid.h's, not quantize.h's
};

struct QuantFormatInfo {
  QuantFormat format;
  const char* name;  // as a recipe spells it
  GridKind kind;
  int64_t bits;  // fixed width of a float format; the widest allowed for int
  // Minifloats only:
  int exponent_bits = 0;
  int mantissa_bits = 0;
  int exponent_bias = 0;
  // The largest magnitude on the grid: a float format's scale is absmax / max_value. 1 for the
  // bitsandbytes tables (scale = absmax), unused for int.
  double max_value = 0.0;
  FourBitType four_bit_type = FourBitType::kNf4;  // tables only
};

const QuantFormatInfo& quant_format_info(QuantFormat format);
// Every format, in the table's order (the order the choices are listed in).
const std::vector<QuantFormat>& quant_formats();
// "int" | "fp8_e4m3" | "fp8_e5m2" | "fp4_e2m1" | "nf4" | "fp4" | "gguf"; anything else is an Error
// naming `what` (a key) and the choices.
QuantFormat parse_quant_format(const std::string& name, const std::string& what);
const char* quant_format_name(QuantFormat format);

}  // namespace qtrain::qat
