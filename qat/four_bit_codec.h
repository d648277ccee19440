#pragma once
// bitsandbytes' blockwise 4-bit quantization (functional.quantize_4bit / dequantize_4bit), bit for
// bit, and the 8-bit blockwise quantization with the dynamic map that its double quantization
// uses (quantize_blockwise / dequantize_blockwise).
//
// quantize_4bit(W), W of any shape, read as its n = W.numel() elements in row-major order:
//   blocks of `blocksize` elements (the last one partial when blocksize does not divide n);
//   absmax[b] = max |W| over block b, fp32;
//   code[i]   = the 4-bit format's choice (FourBitFormat::quantize) for W[i] * (1 / absmax[b]),
//               both factors fp32, the reciprocal rounded first;
//   packed    = uint8 [ceil(n / 2), 1], element 2k in the HIGH nibble of byte k, 2k+1 in the low;
//               an odd n pads the last low nibble with the code of 0 * (1 / absmax[b]), as bnb
//               quantizes its zero padding (the code of 0.0; code 0 for a block of zeros).
// Double quantization (bnb's compress_statistics) replaces absmax by
//   offset = mean(absmax)  (fp32, as torch.mean takes it on CUDA),
//   absmax_q, nested_absmax = quantize_blockwise(absmax - offset, signed dynamic map, 256).
// dequantize: value[i] = code_table[code[i]] * absmax[b] in fp32, then cast to the asked dtype,
// where a double-quantized absmax is first rebuilt as nested_code[absmax_q] * nested_absmax + offset.
//
// Where it runs: CUDA tensors go to the kernels of kernels/blockwise_quantize.h (no copy to the
// host; dequantize_4bit is one kernel), everything else to the CPU reference path here.
//   - The CUDA path is bit-exact with bitsandbytes' CUDA kernels: all 24 cases of the fixture
//     bnb-4bit-reference.safetensors, NF4 and FP4, packed bytes, absmax, nested absmax, offset and
//     dequantized values. bnb builds with --use_fast_math, so its 1 / absmax is the GPU's
//     approximate reciprocal (within one fp32 step of the exact one) and subnormals flush to zero;
//     the kernels use the same instructions.
//   - The CPU path takes the exact reciprocal, which no CPU instruction rounds like the GPU's: where
//     x * (1 / absmax) lands within that step of a pivot its code can differ from bnb's (a few codes
//     in ten thousand in the fixtures, FP4 only), and a subnormal weight or product is kept. The two
//     paths agree everywhere else, dequantization included.
#include <torch/types.h>

#include <string>
#include <vector>

#include "kernels/blockwise_8bit.h"
#include "qat/four_bit_format.h"

namespace qtrain::qat {

// bitsandbytes' 4-bit blocksizes: 64, 128, ..., 4096. Anything else is an Error naming it.
void check_four_bit_blocksize(int64_t blocksize);

constexpr int64_t kNestedBlocksize = 256;  // bnb's blocksize for the absmax of double quantization

// bnb's QuantState for a 4-bit tensor.
struct FourBitQuantState {
  FourBitType quant_type = FourBitType::kNf4;
  int64_t blocksize = 64;
  std::vector<int64_t> shape;                  // of the tensor before quantization
  torch::ScalarType dtype = torch::kBFloat16;  // of the tensor before quantization
  torch::Tensor code;    // fp32 [16], the format's table (bnb's `quant_map`)
  torch::Tensor absmax;  // fp32 [blocks]; uint8 [blocks] (codes of the dynamic map) when double quantized
  // Double quantization only (undefined otherwise):
  torch::Tensor nested_absmax;  // fp32 [ceil(blocks / 256)]
  torch::Tensor nested_code;    // fp32 [256], the signed dynamic map (`nested_quant_map`)
  float offset = 0.0f;          // the mean added back to the dequantized absmax (`nested_offset`)

  bool double_quant() const { return nested_absmax.defined(); }
  int64_t numel() const;
  int64_t blocks() const;  // ceil(numel / blocksize)
  // Shapes and dtypes agree with each other and with `packed`; an Error naming `what` otherwise.
  void check(const torch::Tensor& packed, const std::string& what) const;
};

struct FourBitTensor {
  torch::Tensor packed;  // uint8 [ceil(n / 2), 1]
  FourBitQuantState state;
};

// `input`: a floating-point tensor on any device; the results are on its device.
FourBitTensor quantize_4bit(const torch::Tensor& input, FourBitType quant_type, int64_t blocksize,
                            bool double_quant);
// The tensor in state.shape and `dtype`, on packed's device.
torch::Tensor dequantize_4bit(const torch::Tensor& packed, const FourBitQuantState& state, torch::ScalarType dtype);
// Quantization blocks [first, first + count) of the tensor dequantized alone, flat (the last may
// be the tensor's partial block): the values dequantize_4bit gives there. An Error outside it.
torch::Tensor dequantize_4bit_blocks(const torch::Tensor& packed, const FourBitQuantState& state, int64_t first,
                                     int64_t count, torch::ScalarType dtype);
// A 2-d [out, in] tensor dequantized to bf16 (dequantize_4bit), then coded as e4m3 at the given
// row scales (fp32 [out, 1]): codes = e4m3(clamp(bf16 value / row scale, +-448)), the bytes
// quantize_rows_float8 (qat/float8_codec.h) writes for the bf16 weight whose scales these are. On
// CUDA one kernel from the packed bytes (kernels/blockwise_quantize.h); `in` a multiple of 8 there.
torch::Tensor dequantize_4bit_to_float8(const torch::Tensor& packed, const FourBitQuantState& state,
                                        const torch::Tensor& row_scales);
// The per-block absmax as fp32 [blocks] (rebuilt when double quantized).
torch::Tensor dequantize_absmax(const FourBitQuantState& state);

// The 8-bit blockwise quantization of double quantization lives in kernels/ (the 8-bit optimizers
// use it too); these names keep it reachable from the codec.
using kernels::BlockwiseQuantized;
using kernels::dequantize_blockwise_8bit;
using kernels::quantize_blockwise_8bit;

}  // namespace qtrain::qat
