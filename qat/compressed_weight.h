#pragma once
// A weight as a compressed-tensors checkpoint stores it (what llm-compressor writes and vLLM and
// transformers read), one of its compression formats, and the two ways to make one: round a
// dense weight to nearest as llm-compressor's QuantizationModifier does (post-training), or take a
// QAT layer's trained codes as they are. The frozen base that multiplies from it is
// qat/compressed_linear.h; the checkpoint's names and config.json, trainer/formats/compressed_tensors.h.
//
//   format                data                                     scale                     more
//   pack-quantized        int32 [out, ceil(in * bits / 32)]:       [out, in / group] or      weight_zero_point (asymmetric):
//                         element i's bits (q + 2^(bits-1)) at      [out, 1] per channel,     int32, the [out, groups]
//                         bit i * bits of the row, word by word,   the weight's dtype        zero points packed the same
//                         low bits first (int4: 8 to a word)                                 way along dim 0
//   int-quantized         int8 [out, in] codes q                   as above                  int8 zero points [out, groups]
//   float-quantized       float8_e4m3fn [out, in]                  as above
//   nvfp4-pack-quantized  uint8 [out, in / 2]: two e2m1 codes,     float8_e4m3fn [out, in/16] weight_global_scale fp32 [1]
//                         the even element in the low nibble
// Beside them, transformers' fine-grained FP8 (quant_method "fp8": Qwen3-*-FP8, DeepSeek), kept
// the same way: float8_e4m3fn [out, in] and `weight_scale_inv` fp32 [ceil(out / block_rows),
// ceil(in / block_columns)], dequantized as transformers does it, the product in fp32 rounded once.
// Dequantized as transformers runs compressed-tensors' decompression in a model of dtype D: the
// scales read into D, (q - z) * s or q * s (e4m3) computed in D; nvfp4's codes times scale /
// global_scale in fp32, rounded to bf16 (its unpacking's dtype), whatever D.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "qat/quant_presets.h"
#include "qat/quant_spec.h"
#include "qat/quantize.h"

namespace qtrain::qat {

enum class CompressionFormat { kPackQuantized, kIntQuantized, kFloatQuantized, kNvfp4PackQuantized, kFp8Blocks };

// config.json's names ("pack-quantized", ...: compressed-tensors' formats, not kFp8Blocks); an
// Error naming `what` for any other.
CompressionFormat parse_compression_format(const std::string& name, const std::string& what);
const char* compression_format_name(CompressionFormat format);

struct CompressedWeight {
  CompressionFormat format = CompressionFormat::kPackQuantized;
  // The grid: int (any width 2..8, per_group / per_channel / per_tensor, either symmetry) or
  // fp8_e4m3, with compressed-tensors' conventions; nvfp4: fp4_e2m1 per_group(16), whose group
  // scales are the e4m3 `scale` under `global_scale`.
  QuantSpec spec;
  int64_t out_features = 0;
  int64_t in_features = 0;
  torch::Tensor data;          // the stored codes (table above)
  torch::Tensor scale;         // stored dtype
  torch::Tensor zero_point;    // asymmetric grids only
  torch::Tensor global_scale;  // nvfp4 only
  int64_t block_rows = 0;      // kFp8Blocks: the rows and columns one scale covers
  int64_t block_columns = 0;

  // q of every element, int8 [out, in] (int grids); the grid's value, fp32 [out, in] (float grids).
  torch::Tensor codes() const;
  // The weight transformers decompresses this to in a model of `dtype` (above).
  torch::Tensor dequantize(torch::ScalarType dtype) const;
  // Bytes on the device: what the memory estimate counts.
  int64_t stored_bytes() const;
  // Every tensor on `device`.
  CompressedWeight to(const torch::Device& device) const;
};

// Rounds `weight` [out, in] to nearest onto `preset`'s grid as llm-compressor's QuantizationModifier
// does without calibration data (min / max of each group or row, quant_presets.h's formulas), in
// the weight's own dtype: what it writes for a model loaded in that dtype. NVFP4's global scale
// comes from `tensor_absmax` when defined (llm-compressor gives q/k/v and gate/up, which vLLM
// fuses, the largest magnitude of the three or two), else from the weight's own.
CompressedWeight compress_weight(const QuantPreset& preset, const torch::Tensor& weight,
                                 const torch::Tensor& tensor_absmax = {});

// The stored form of codes and scales a quantizer already chose (a QAT layer's convert()); its
// spec must be one compressed-tensors stores (format int or fp8_e4m3, integer zero point). The
// scale keeps its fp32 values (stored in `scale_dtype`, which must hold them exactly).
CompressedWeight compressed_weight_from_codes(const QuantizedTensor& quantized, CompressionFormat format,
                                              torch::ScalarType scale_dtype);

// The dense bit packing of pack-quantized: int8 codes of `bits` bits (each in [-2^(bits-1),
// 2^(bits-1))) along dimension `packed_dim` (0 or 1) of a 2-d tensor, into int32 words.
torch::Tensor pack_int32(const torch::Tensor& codes, int64_t bits, int64_t packed_dim);
// Its inverse: `count` codes along `packed_dim`, int8.
torch::Tensor unpack_int32(const torch::Tensor& words, int64_t bits, int64_t count, int64_t packed_dim);

}  // namespace qtrain::qat
