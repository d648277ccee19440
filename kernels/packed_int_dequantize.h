#pragma once
// compressed-tensors' pack-quantized int4 / int8 weights (qat/compressed_weight.h) dequantized in
// one pass, one thread per int32 word of codes:
//   q     = (word >> (bits * k)) & (2^bits - 1), minus 2^(bits-1)       element k of the word
//   z     = the zero point of (row, group), packed the same way along rows; 0 without zero points
//   value = (q - z) * s, s = scale[row, column / group] (or the tensor's one scale), in `dtype`
// (q - z) is an integer every dtype holds exactly and the product is rounded once to `dtype`, as
// torch's operations (CompressedWeight::dequantize's reference path) round it, so the bits equal
// theirs. Why: those operations pass over the weight five times per product (unpack, two casts,
// subtract, multiply); a frozen W4A16 base dequantizes every projection in every forward and in
// backward.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

// `words`: int32 [rows, ceil(columns * bits / 32)] CUDA, contiguous; `scale`: [rows, groups] or
// [1], already in `dtype` (float, half or bfloat16); `zero_words`: int32 [ceil(rows * bits / 32),
// groups] or undefined; bits 4 or 8; columns divisible by groups. Returns `dtype` [rows, columns].
at::Tensor dequantize_packed_int_cuda(const at::Tensor& words, const at::Tensor& scale, const at::Tensor& zero_words,
                                      int64_t bits, int64_t columns);

}  // namespace qtrain::kernels
