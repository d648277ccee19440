#pragma once
// bitsandbytes' blockwise quantization on CUDA, bit for bit with its CUDA kernels
// (kQuantizeBlockwise / kDequantizeBlockwise in bnb's csrc/kernels.cu): the 4-bit NF4/FP4 codec
// and the 8-bit dynamic-map quantization that its double quantization applies to the absmax.
//
// These are raw entry points: tensors and plain numbers in, tensors out, on the input's device and
// current stream. What the numbers mean (the format tables, the quant state, the CPU reference path
// that must agree) lives in qat/four_bit_codec.h, whose functions dispatch here for CUDA tensors.
//
// Arithmetic as bnb's kernels do it. bnb compiles them with --use_fast_math, which turns
// 1.0f / absmax into the GPU's approximate reciprocal (rcp.approx.ftz: within one fp32 step of the
// exact one) and flushes subnormal operands and products to zero; these kernels use exactly those
// instructions (kernels/bnb_fast_math.cuh). So codes, absmax and dequantized values equal bnb's
// everywhere, and the CPU reference's wherever x * (1 / absmax) is not within a step of a pivot and
// no value is subnormal.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

#include "kernels/cuda_build.h"

namespace qtrain::kernels {


// How a 4-bit format picks the code of a normalized value x = w * (1 / absmax), as plain data
// (qat::FourBitFormat holds the tables): rank = the number of thresholds t with x > t (fp32
// compares; a value on a threshold goes lower), code = code_of_rank[rank]. When sign_magnitude,
// the rank is that of |x| and 8 is added for x < 0.
struct FourBitQuantizer {
  c10::ArrayRef<float> thresholds;       // ascending, at most 15
  c10::ArrayRef<uint8_t> code_of_rank;   // thresholds.size() + 1 codes, each < 16
  bool sign_magnitude = false;
};

struct BlockwiseCodes {
  at::Tensor codes;   // uint8: 4-bit: [ceil(n / 2)], element 2k in the high nibble of byte k; 8-bit: [n]
  at::Tensor absmax;  // fp32 [ceil(n / blocksize)], max |w| of each block
};

// `input`: a contiguous fp32 / fp16 / bf16 CUDA tensor of n elements in blocks of `blocksize` (a
// power of two, 8..4096; the last block partial when it does not divide n). An odd n pads the last
// low nibble with the code of 0 * (1 / absmax), as bnb's zero padding does.
BlockwiseCodes quantize_4bit_cuda(const at::Tensor& input, const FourBitQuantizer& quantizer, int64_t blocksize);

// bnb's 8-bit quantize_blockwise (deterministic rounding): per block absmax, then the code of `code`
// (fp32 [256], sorted, on input's device) that bnb's binary search (dQuantize) picks for
// x * (1 / absmax). `input`: a contiguous fp32 / fp16 / bf16 CUDA tensor; blocksize 1..4096.
BlockwiseCodes quantize_blockwise_8bit_cuda(const at::Tensor& input, const at::Tensor& code, int64_t blocksize);

// The per-block scales of a 4-bit tensor, on the packed codes' device. Double quantization stores
// absmax[b] as an 8-bit code and rebuilds it as nested_code[absmax[b]] * nested_absmax[b / nested_blocksize]
// + offset, rounded to fp32 after the product and after the sum (bnb's dequantize_blockwise, then
// torch's `absmax += offset`).
struct FourBitScales {
  at::Tensor absmax;         // fp32 [blocks]; uint8 [blocks] when nested_absmax is defined
  at::Tensor nested_absmax;  // fp32 [ceil(blocks / nested_blocksize)], double quantization only
  at::Tensor nested_code;    // fp32 [256], the 8-bit map of the absmax codes
  float offset = 0.0f;       // the mean the absmax values were centred by
  int64_t nested_blocksize = 256;
};

// value[i] = decode[code[i]] * absmax[i / blocksize] in fp32, written as `dtype` (fp32 / fp16 / bf16,
// rounded to nearest even): flat [numel] on packed's device. `packed`: contiguous uint8
// [ceil(numel / 2)]; `decode`: the 16 values the codes stand for (FP4's code 8 is -0.0).
at::Tensor dequantize_4bit_cuda(const at::Tensor& packed, int64_t numel, int64_t blocksize,
                                c10::ArrayRef<float> decode, const FourBitScales& scales, c10::ScalarType dtype);

// The same values rounded to bf16 (the weight the bf16 path multiplies by), then coded as e4m3 at
// their row's scale: codes[i] = e4m3(clamp(bf16(value[i]) / row_scales[i / row_length], +-448)),
// rounded as c10's cast, as quantize_rows_float8 (kernels/float8_rows.h) codes the bf16 weight when
// given its scales. One pass from the packed bytes to the FP8 tensor cores' operand: 1.5 bytes
// moved a weight instead of the bf16 path's 2.5. row_length a multiple of 8; row_scales fp32
// [numel / row_length]; flat float8_e4m3fn [numel].
at::Tensor dequantize_4bit_to_float8_cuda(const at::Tensor& packed, int64_t numel, int64_t blocksize,
                                          c10::ArrayRef<float> decode, const FourBitScales& scales,
                                          const at::Tensor& row_scales, int64_t row_length);

}  // namespace qtrain::kernels
