#pragma once
// bitsandbytes' 8-bit blockwise quantization with a dynamic map (functional.quantize_blockwise /
// dequantize_blockwise, deterministic rounding): what its 4-bit double quantization applies to the
// absmax values and what its 8-bit optimizers store their states in.
//
// quantize: per block of `blocksize` values absmax = max |x| (fp32), then for x * (1 / absmax)
// (both factors fp32, the reciprocal rounded first) the code of the 256-entry map that bnb's binary
// search picks (kernels/dynamic_map_code.h). dequantize: map[code] * absmax, fp32.
//
// Where it runs: CUDA tensors go to the kernel of kernels/blockwise_quantize.h (bit-exact with bnb's
// CUDA kernel, whose 1 / absmax is the GPU's approximate reciprocal), everything else to the CPU
// reference here, which takes the exact reciprocal: the two differ only where x * (1 / absmax)
// lands within one fp32 step of a pivot. The fixture bnb-8bit-reference.safetensors
// (`blockwise.*`) checks both against bitsandbytes.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace qtrain::kernels {

// bitsandbytes' create_dynamic_map(signed): 256 sorted fp32 values. For each decimal exponent
// e = -6..0, the means of a linspace(0.1, 1) split into 2^(e+6) (signed: both signs) or 2^(e+7)
// (unsigned) segments, times 10^e, plus 0 and 1. Built with torch's own fp32 linspace and
// arithmetic, as bnb builds it, so it equals bnb's table bit for bit. fp32 [256] CPU tensors.
//   signed: [-1, 1], the first moment of the 8-bit optimizers and double quantization's absmax;
//   unsigned: [0, 1], the second moment.
at::Tensor signed_dynamic_map();
at::Tensor unsigned_dynamic_map();

struct BlockwiseQuantized {
  at::Tensor codes;   // uint8, input's shape
  at::Tensor absmax;  // fp32 [ceil(n / blocksize)]
};

// `input`: a floating-point tensor on any device (results on its device); `code`: fp32 [256],
// sorted; blocksize >= 1 (at most 4096 on CUDA).
BlockwiseQuantized quantize_blockwise_8bit(const at::Tensor& input, const at::Tensor& code, int64_t blocksize);
// code[codes] * absmax[block] in fp32, in codes' shape, on codes' device.
at::Tensor dequantize_blockwise_8bit(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
                                     int64_t blocksize);

}  // namespace qtrain::kernels
