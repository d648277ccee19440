#pragma once
// QAT of a LoRA layer's merged weight in one pass, tile by tile, without an fp32 copy of it:
//
//     M = W0 + scale * (B A)          (fp32; each product and sum rounded on its own, j = 0 .. r-1
//                                      in order: acc = acc + B[o, j] * A[j, k], then W0 + scale * acc)
//     per block of M (a row's `block_length` consecutive values): min, max -> scale s, zero point z
//     q = clamp(round_half_even(M / s) + z, quant_min, quant_max),   value = (q - z) * s
//
// with s and z as qat/quantize.cpp's choose_qparams computes them on the CPU (true divisions,
// eps, the fp16 rounding of GGUF's scales). Every operation is an IEEE fp32 operation in a fixed
// order, so the CUDA kernel gives the bits of qat/qat_lora_matmul.cpp's torch-operation path on
// the CPU: a run trained on a GPU exports on the CPU the exact weights its last forward used.
// Why: the unfused composition writes and reads the [out, in] merged weight in fp32 about ten
// times per layer and forward (docs/QAT.md), which made a QAT step 1.8-3.7x a plain one.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

struct MergedFakeQuantizeOptions {
  int64_t block_length = 32;  // values per scale along a row (a group, or the whole row)
  int64_t quant_min = -8;
  int64_t quant_max = 7;
  bool symmetric = true;
  bool fp16_scale = false;    // round scales to fp16 (GGUF's d)
  // What to write: the fake-quantized values in `values_dtype` (the matmul's operand), the int8
  // codes (an export), the straight-through mask (the masked gradient). Scales and zero points
  // always.
  bool values = true;
  c10::ScalarType values_dtype = c10::ScalarType::BFloat16;
  bool codes = false;
  bool inside = false;
};

struct MergedFakeQuantized {
  at::Tensor values;      // [out, in] values_dtype, or undefined
  at::Tensor codes;       // [out, in] int8, or undefined
  at::Tensor scale;       // [out, in / block_length] fp32
  at::Tensor zero_point;  // [out, in / block_length] fp32 (zeros when symmetric)
  at::Tensor inside;      // [out, in] bool, or undefined: quant_min <= round(M / s) + z <= quant_max
};

// base [out, in] fp32 / fp16 / bf16 (W0 exactly; widened to fp32); lora_A [r, in] and lora_B
// [out, r] fp32; all contiguous on one CUDA device; block_length divides in.
MergedFakeQuantized merged_fake_quantize_int_cuda(const at::Tensor& base, const at::Tensor& lora_A,
                                                  const at::Tensor& lora_B, double lora_scale,
                                                  const MergedFakeQuantizeOptions& options);

}  // namespace qtrain::kernels
