#pragma once
// What a quantizer is: its grid (quant_format.h), its width, symmetric or asymmetric, which
// elements share a scale, and the dtype the scale is stored in. The conventions, stated once:
//
// Blocks. A tensor x is read as [rows, K], K its last dimension, rows every leading index:
//   per_tensor               one scale for all of x                     params shape [1]
//   per_channel / per_token  one per row: a weight's output channel,    params shape x.shape[:-1] + [1]
//                            an activation's token (the same math)
//   per_group                one per `group_size` consecutive elements  params shape x.shape[:-1] + [K / group_size]
//                            of a row (K must be a multiple)
// Within a block, min and max are taken over its elements.
//
// Integer grids (torchao's affine conventions, those of its int4 weight QAT and of
// Int8DynActInt4Weight; "INT" zero-point domain):
//   range        q in [quant_min, quant_max] = [-2^(bits-1), 2^(bits-1) - 1], signed for both
//                mappings (int4: [-8, 7], int8: [-128, 127])
//   quantize     q = clamp(round(x / s) + z, quant_min, quant_max), x / s a true fp32 division,
//                round half to even
//   dequantize   x^ = (q - z) * s, fp32
//   symmetric    z = 0, s = max(-min(x), max(x)) / ((quant_max - quant_min) / 2)   (int4: absmax / 7.5)
//                so -absmax maps to quant_min and +absmax to quant_max + 0.5, which rounds (to
//                even) past quant_max and is clipped to it: torchao's choice, it keeps the grid's
//                full negative end.
//   asymmetric   s = (max(max(x), 0) - min(min(x), 0)) / (quant_max - quant_min),
//                z = clamp(quant_min - round(min(min(x), 0) / s), quant_min, quant_max), an integer
//                (the range always holds 0, so 0 is exact)
// Float grids (minifloats and bitsandbytes' tables) are symmetric only: z = 0,
//   s = absmax / max_value, x^ = grid(x / s) * s; the tables take x * (1 / s) as bitsandbytes does.
// Every scale is at least eps = 2^-23 (fp32's machine epsilon, torchao's), so an all-zero block
// quantizes to zeros. With scale_dtype fp16 the scale is then clamped to fp16's range and rounded
// to fp16, and that rounded value is the scale the forward uses: it is what GGUF's Q4_0 / Q8_0
// store as the block's `d`, so an exported file dequantizes to exactly the fake-quant weights.
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qat/quant_format.h"

namespace qtrain::qat {

enum class Granularity { kPerTensor, kPerChannel, kPerToken, kPerGroup };

// "per_tensor" | "per_channel" | "per_token" | "per_group"; anything else is an Error naming `what`.
Granularity parse_granularity(const std::string& name, const std::string& what);
const char* granularity_name(Granularity granularity);

struct QuantSpec {
  QuantFormat format = QuantFormat::kInt;
  int64_t bits = 4;  // 2..8 for int; a float format's own width (fp8: 8, fp4 / nf4: 4)
  bool symmetric = true;
  Granularity granularity = Granularity::kPerGroup;
  int64_t group_size = 32;  // per_group only
  torch::ScalarType scale_dtype = torch::kFloat32;  // kFloat32, or kFloat16 (GGUF's d)

  // The integer grid's ends (int format only): [-2^(bits-1), 2^(bits-1) - 1].
  int64_t quant_min() const;
  int64_t quant_max() const;
  bool is_integer() const { return format == QuantFormat::kInt; }
  const QuantFormatInfo& format_info() const { return quant_format_info(format); }

  // The spec alone makes sense; an Error naming `what` (the recipe key of the spec, such as
  // "qat.weights") + the field, its value and the reason otherwise.
  void validate(const std::string& what) const;
  // And it applies to a tensor of `shape`: a group size must divide the last dimension.
  void validate_for_shape(const std::string& what, c10::IntArrayRef shape) const;

  // "int4 symmetric per_group(32) scale fp16": for messages and files' metadata.
  std::string describe() const;

  // The schemes GGUF holds exactly: symmetric int4 / int8 in groups of 32, fp16 scales.
  static QuantSpec gguf_q4_0();
  static QuantSpec gguf_q8_0();
  // torchao's Int8DynActInt4Weight: int4 symmetric weights per group (its default group 256;
  // pass yours), int8 asymmetric activations per token, computed on every call.
  static QuantSpec int4_weight(int64_t group_size);
  static QuantSpec int8_dynamic_per_token_activation();
};

// Shapes of the blocks view and of the parameters (scale, zero point) for `shape` (see above).
// block_view_shape: params shape + [block length]; x.reshape(block_view_shape) lines each
// block up along the last dimension. The spec must be valid for the shape.
std::vector<int64_t> params_shape(const QuantSpec& spec, c10::IntArrayRef shape);
std::vector<int64_t> block_view_shape(const QuantSpec& spec, c10::IntArrayRef shape);

}  // namespace qtrain::qat
