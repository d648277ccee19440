#pragma once
// One step of the 8-bit AdamW (optim/adamw8bit.h) on CUDA in one kernel: dequantize both moments,
// update them and the parameter, quantize the moments again. The torch-operation path of
// optim/adamw8bit.cpp is its reference: every fp32 operation here rounds where one of those
// operations rounds (no fused multiply-adds), and the quantization is kernels/blockwise_quantize.h's
// bnb-exact one, so codes, absmax values and parameters equal the reference's bit for bit.
//
// Why: the reference launches about 40 small kernels per parameter; a LoRA model has hundreds of
// parameters, so the optimizer step was launch-bound (8B QLoRA: 4,032 against 8,990 tokens/s).
#include <ATen/core/Tensor.h>

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

// The step's fp32 constants, computed on the host as the reference computes them.
struct AdamW8bitStepScalars {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float eps_term;      // sqrt(1 - beta2^t) * eps
  float step_size;     // -lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  float decay_factor;  // 1 - lr * weight_decay, applied when apply_decay
  bool apply_decay;
};

// In place, on the tensors' CUDA device and current stream. `parameter`, `grad`: contiguous fp32,
// n elements; `state1`, `state2`: contiguous uint8, n codes; `absmax1`, `absmax2`: fp32
// [ceil(n / 256)]; `signed_map`, `unsigned_map`: fp32 [256] on the same device. Blocks of 256.
void adamw8bit_step_cuda(at::Tensor& parameter, const at::Tensor& grad, at::Tensor& state1, at::Tensor& absmax1,
                         at::Tensor& state2, at::Tensor& absmax2, const at::Tensor& signed_map,
                         const at::Tensor& unsigned_map, const AdamW8bitStepScalars& scalars);

}  // namespace qtrain::kernels
