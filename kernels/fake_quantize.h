#pragma once
// Integer fake quantization on CUDA in one pass: for each value x of block b,
//   unclamped = round_half_even(x / scale[b]) + zero_point[b]
//   value     = (clamp(unclamped, quant_min, quant_max) as int8 - zero_point[b]) * scale[b]
//   inside    = quant_min <= unclamped <= quant_max   (the straight-through estimator's mask)
// each operation rounded in fp32 as qat/quantize.cpp's torch operations round it (its reference
// path), so values and mask equal theirs bit for bit. Why: those operations read and write the
// whole weight about ten times per fake-quantized forward; QAT fake-quantizes every weight in
// every forward (and again in a checkpointed layer's recomputation).
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

struct FakeQuantizedValues {
  at::Tensor values;  // fp32, blocks' shape
  at::Tensor inside;  // bool, blocks' shape
};

// `blocks`: contiguous fp32 CUDA tensor whose last dimension is one quantization block (the block
// view of qat/quant_spec.h); `scale`, `zero_point`: contiguous fp32, one value per block, on its
// device; quant_min < quant_max within int8.
FakeQuantizedValues fake_quantize_int_cuda(const at::Tensor& blocks, const at::Tensor& scale,
                                           const at::Tensor& zero_point, int64_t quant_min, int64_t quant_max);

}  // namespace qtrain::kernels
