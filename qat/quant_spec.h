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
//                round half to even (torchao multiplies by the fp32 reciprocal 1 / s instead: the
//                two round apart, by one step, only where x / s lies within an ulp of a tie)
//   dequantize   x^ = (q - z) * s, fp32
//   symmetric    z = 0, s = max(-min(x), max(x)) / ((quant_max - quant_min) / 2)   (int4: absmax / 7.5)
//                so -absmax maps to quant_min and +absmax to quant_max + 0.5, which rounds (to
//                even) past quant_max and is clipped to it: torchao's choice, it keeps the grid's
//                full negative end.
//   asymmetric   s = (max(max(x), 0) - min(min(x), 0)) / (quant_max - quant_min),
//                z = clamp(quant_min - round(min(min(x), 0) / s), quant_min, quant_max), an integer
//                (the range always holds 0, so 0 is exact)
//   arithmetic   s and z are computed in x's dtype when x is bf16 or fp16, every operation rounded
//                to it, as torchao's choose_qparams_affine computes them (a bf16 activation's fp32
//                scale holds a bf16 value); in fp32 otherwise, and from an observer's fp32 range.
// Float zero-point domain (zero_point_domain float: torchao's int4 weight-only QAT,
// QATConfig(Int4WeightOnlyConfig(group_size)), whose Int4WeightFakeQuantizer emulates MSLK's
// int4_row_quantize_zp). Asymmetric int grids only, fp32 scales, computed in fp32 whatever x's
// dtype. The grid spans the block's own range [m, M] = [min(x), max(x)]; 0 need not be exact:
//   s  = max(M - m, 1e-6) / (quant_max - quant_min)        (its eps, on the range)
//   q  = clamp(round((x - m) / s) + quant_min, quant_min, quant_max)
//   x^ = q * s + z,  z = m - quant_min * s                  (torchao's float zero point, the value
//                                                            of code 0; each operation fp32)
// The quantizer keeps m as its zero point (QuantParams), so codes and values are torchao's bits.
// Float grids (minifloats and bitsandbytes' tables) are symmetric only: z = 0,
//   s = absmax / max_value, x^ = grid(x / s) * s; the tables take x * (1 / s) as bitsandbytes does.
// Every other scale is at least eps = 2^-23 (fp32's machine epsilon, torchao's for 8da4w
// activations; its weights take fp32's smallest normal number, which only blocks within 2^-20 of
// zero tell apart), so an all-zero block quantizes to zeros. With scale_dtype fp16 the
// scale is then clamped to fp16's range and rounded to fp16, and that rounded value is the scale
// the forward uses: it is what GGUF's Q4_0 / Q8_0 store as the block's `d`, so an exported file
// dequantizes to exactly the fake-quant weights.
// compressed-tensors' convention (QuantConvention::kCompressedTensors, its presets: quant_presets.h)
// differs in two places, and a spec that follows it computes its way: a scale that comes out 0
// becomes eps (a smaller one is kept), and an asymmetric grid adds the zero point before rounding,
//   z = round(clamp(quant_min - min / s, quant_min, quant_max)),  q = round(clamp(x / s + z, quant_min, quant_max));
// each operation in x's dtype (fp32 for fp32 weights; a bf16 weight's scale and quotient are bf16).
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"
#include "qat/quant_format.h"
#include "qat/quant_presets.h"

namespace qtrain::qat {

enum class Granularity { kPerTensor, kPerChannel, kPerToken, kPerGroup };

// Where the zero point acts (torchao's ZeroPointDomain): on the integer codes, or as a float
// offset of the block's range (see above).
enum class ZeroPointDomain { kInt, kFloat };

// "per_tensor" | "per_channel" | "per_token" | "per_group"; anything else is an Error naming `what`.
Granularity parse_granularity(const std::string& name, const std::string& what);
const char* granularity_name(Granularity granularity);
// Whose conventions the grid follows where torchao's and compressed-tensors' differ (above).
enum class QuantConvention { kTorchao, kCompressedTensors };

// "int" | "float"; anything else is an Error naming `what`.
ZeroPointDomain parse_zero_point_domain(const std::string& name, const std::string& what);
const char* zero_point_domain_name(ZeroPointDomain domain);

// How the scales of the groups are themselves stored, when they are (a second level of scales).
// One level, the default, keeps each group's scale in scale_dtype as it is. The formats with two
// levels, which llama.cpp and the OCP / NVIDIA 4-bit formats use:
//   K-quants (Q4_K, ...)  super-blocks of 256 elements = 8 groups of 32: each group's scale, and
//                         its min (value = d * scale_q * q - dmin * min_q, q unsigned), is a 6-bit
//                         code; the super-block holds the fp16 d and dmin those codes multiply
//   MXFP4                 fp4_e2m1 elements in groups of 32, each group's scale a shared 8-bit
//                         exponent (E8M0: a power of two), nothing above it
//   NVFP4                 fp4_e2m1 elements in groups of 16, each group's scale an fp8 e4m3 code
//                         times one fp32 scale of the whole tensor
// Described here so that the GGUF block types (qat/gguf_block_format.h) and exports can tell
// such a scheme apart; qtrain's quantizers (quantize.h) compute one level only, so validate()
// refuses a spec that sets one.
enum class ScaleEncoding {
  kDirect,     // one level: the group's scale in scale_dtype
  kInteger,    // an unsigned `bits`-bit code times the super-block's scale (K-quants)
  kExponent,   // a power of two, its 8-bit exponent stored (E8M0, MXFP4); no scale above it
  kFloat8,     // an fp8 e4m3 code times the super-block's scale (NVFP4)
};

struct ScaleLevel {
  ScaleEncoding encoding = ScaleEncoding::kDirect;
  int64_t bits = 0;              // of each group's scale code: 6 (K-quants), 8 (E8M0, e4m3)
  bool has_mins = false;         // each group also has a min, coded alike (K-quants' dmin * m)
  int64_t super_block_size = 0;  // elements under one second-level scale: 256 (K-quants); 0: the whole tensor (NVFP4)
  torch::ScalarType super_scale_dtype = torch::kFloat16;  // fp16 (K-quants' d, dmin) or fp32 (NVFP4)

  bool is_two_level() const { return encoding != ScaleEncoding::kDirect; }
};

struct QuantSpec {
  QuantFormat format = QuantFormat::kInt;
  int64_t bits = 4;  // 2..8 for int; a float format's own width (fp8: 8, fp4 / nf4: 4)
  bool symmetric = true;
  Granularity granularity = Granularity::kPerGroup;
  int64_t group_size = 32;  // per_group only
  torch::ScalarType scale_dtype = torch::kFloat32;  // kFloat32, or kFloat16 (GGUF's d)
  ZeroPointDomain zero_point_domain = ZeroPointDomain::kInt;  // kFloat: asymmetric int, fp32 scales
  ScaleLevel group_scales;  // how the scales of the groups are stored (above): directly, by default
  // Format gguf only: the llama.cpp block type the weight is rounded onto (qat/gguf_grid.h), its
  // codes and every level of its scales as the block stores them. granularity per_group with
  // group_size the type's block (32, or a k-quant's 256); the other fields are unused.
  GgufBlockType gguf_block = GgufBlockType::kQ4_K;
  QuantConvention convention = QuantConvention::kTorchao;

  // The integer grid's ends (int format only): [-2^(bits-1), 2^(bits-1) - 1].
  int64_t quant_min() const;
  int64_t quant_max() const;
  bool is_integer() const { return format == QuantFormat::kInt; }
  bool is_gguf_block() const { return format == QuantFormat::kGguf; }
  // Integer codes with an integer zero point: the grids kernels/fake_quantize.h computes.
  bool has_integer_zero_point() const { return is_integer() && zero_point_domain == ZeroPointDomain::kInt; }
  const QuantFormatInfo& format_info() const { return quant_format_info(format); }

  // The spec alone makes sense; an Error naming `what` (the recipe key of the spec, such as
  // "qat.weights") + the field, its value and the reason otherwise.
  void validate(const std::string& what) const;
  // And it applies to a tensor of `shape`: a group size must divide the last dimension.
  void validate_for_shape(const std::string& what, c10::IntArrayRef shape) const;

  // "int4 symmetric per_group(32) scale fp16" (+ " zero_point float"): for messages and files'
  // metadata.
  std::string describe() const;

  // The schemes GGUF holds exactly: symmetric int4 / int8 in groups of 32, fp16 scales.
  static QuantSpec gguf_q4_0();
  static QuantSpec gguf_q8_0();
  // Any quantized GGUF block type, its own codes and scales (format gguf).
  static QuantSpec gguf_block_type(GgufBlockType type);
  // torchao's Int8DynActInt4Weight: int4 symmetric weights per group (its default group 256;
  // pass yours), int8 asymmetric activations per token, computed on every call.
  static QuantSpec int4_weight(int64_t group_size);
  static QuantSpec int8_dynamic_per_token_activation();
  // torchao's int4 weight-only QAT, QATConfig(Int4WeightOnlyConfig(group_size)): asymmetric int4
  // per group, float zero point (its default group 128).
  static QuantSpec int4_weight_only(int64_t group_size);
  // A compressed-tensors preset's weight grid and its input activations' (per token; only for a
  // preset that quantizes them), with its conventions; not for the two-level NVFP4 (an Error).
  static QuantSpec compressed_tensors_weights(const QuantPreset& preset);
  static QuantSpec compressed_tensors_activations(const QuantPreset& preset);
};

// Shapes of the blocks view and of the parameters (scale, zero point) for `shape` (see above).
// block_view_shape: params shape + [block length]; x.reshape(block_view_shape) lines each
// block up along the last dimension. The spec must be valid for the shape.
std::vector<int64_t> params_shape(const QuantSpec& spec, c10::IntArrayRef shape);
std::vector<int64_t> block_view_shape(const QuantSpec& spec, c10::IntArrayRef shape);

}  // namespace qtrain::qat
