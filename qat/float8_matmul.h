#pragma once
// y = x W^T for a frozen W held as row-wise FP8 codes (qat/float8_codec.h), its matmuls on FP8
// tensor cores where the GPU has them:
//
//   forward   x is quantized per token (row), then y = (x_q W_q^T) * s_x s_W^T: one torch
//             _scaled_mm with row-wise scales, sums promoted to fp32, written in bf16;
//   backward  dx = g W = (g diag(s_W)) W_q: the output gradient times W's row scales is quantized
//             per token and multiplied by W_q (transposed into the column-major layout the tensor
//             cores read, for this call only), scaled back per token.
//
// W never gets a gradient; the LoRA path and everything it trains stay in bf16/fp32. The error
// against the 16-bit product is e4m3's: each operand within 2^-4 relative per value; over a sum of
// n products that averages out to about 2^-4 / sqrt(3 n) of the output's magnitude
// (tests/qat/float8_linear_test.cpp states what is measured).
//
// Where it runs: bf16 rows on a GPU with FP8 tensor cores (compute capability 8.9+) and in/out
// features multiples of 16 take _scaled_mm. Everything else (the CPU, fp32 or fp16 rows) takes
// the reference: the same quantized operands multiplied in fp32 and scaled after. The tensor
// cores keep about 14 bits of each running sum and promote it to fp32 every few steps (with
// fast accumulation: never), so they differ from the reference by that rounding.
#include <torch/types.h>

#include <string>

#include "qat/float8_codec.h"

namespace qtrain::qat {

// FP8 multiplies on tensor cores or not at all: a GPU without them, or rows in another dtype than
// the bf16 the tensor cores write, would train on the slow reference path unnoticed. An Error
// (kRecipe) naming `what` (the setting that asked for FP8) and `dtype_key` (the one setting the
// dtype) for a CUDA `device` without FP8 tensor cores or a `dtype` other than bf16; the CPU takes
// the reference path (tests, small runs).
void require_float8_tensor_cores(const torch::Device& device, torch::ScalarType dtype, const std::string& what,
                                 const std::string& dtype_key);

// Whether `rows` [tokens, in] times a W [out, in] runs on FP8 tensor cores.
bool float8_tensor_cores(const torch::Tensor& rows, int64_t out_features);

// rows [tokens, in] -> rows W^T [tokens, out] in rows' dtype, without autograd. With
// `fast_accumulation` the tensor cores sum in their own precision (about 14 bits) without
// promoting partial sums to fp32: faster, with errors growing with `in` (torchao's Float8Linear
// does this for its forward; the input gradient here is always promoted).
// `onto`, if defined ([tokens, out], contiguous, rows' dtype), receives the product added onto what
// it holds, in place: on the tensor cores in one pass (cuBLASLt's beta, kernels/float8_gemm.h),
// summed in fp32 and rounded once; on the reference path the same sum in fp32.
torch::Tensor float8_product(const torch::Tensor& rows, const Float8Rows& weight, bool fast_accumulation = false,
                             torch::Tensor onto = {});
// grad_rows [tokens, out] -> grad_rows W [tokens, in] in grad_rows' dtype, without autograd; `onto`
// as above ([tokens, in]).
torch::Tensor float8_input_gradient(const torch::Tensor& grad_rows, const Float8Rows& weight, torch::Tensor onto = {});

// input [..., in] -> [..., out] in input's dtype; backward reaches the input only.
torch::Tensor float8_matmul(const torch::Tensor& input, const Float8Rows& weight, bool fast_accumulation = false);

}  // namespace qtrain::qat
