#pragma once
// The FP8 tensor cores' product of two row-quantized operands through cuBLASLt, whose beta lets it
// accumulate onto what the output already holds. torch's scaled matmul has no beta, so a LoRA
// update had to be added onto its output in a second, memory-bound pass; here the rank-r update
// is written first and the large FP8 product lands on it, as the bf16 path does.
//
//     out[i, j] = left_scales[i] * right_scales[j] * sum_k left[i, k] * right_t[j, k]  (+ out[i, j])
//
// in fp32 (one rounding to the output's dtype at the end), with cuBLASLt's outer-vector scales
// (cuBLAS 12.9 or newer; Ada, Hopper, Blackwell).
#include <ATen/core/Tensor.h>

namespace qtrain::kernels {

// left [m, k] and right_t [n, k] float8_e4m3fn, contiguous (both K-major, as FP8 tensor cores read
// them); left_scales fp32 [m] or [m, 1], right_scales fp32 [n] or [1, n]; out [m, n] bf16,
// contiguous; n and k multiples of 16. accumulate: add onto out (beta = 1), else overwrite it.
// fast_accumulation: the tensor cores' sums without promotion to fp32 (forward only).
// False, with out untouched, where this cuBLASLt cannot run the product (the caller takes torch's
// scaled matmul then); an Error for operands that break the contract above.
bool float8_gemm_cuda(const at::Tensor& left, const at::Tensor& left_scales, const at::Tensor& right_t,
                      const at::Tensor& right_scales, at::Tensor& out, bool accumulate, bool fast_accumulation);

}  // namespace qtrain::kernels
