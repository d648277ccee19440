#pragma once
// LLM.int8's row-wise int8 quantization (Dettmers et al. 2022), as bitsandbytes computes it
// (functional.int8_vectorwise_quant, int8_vectorwise_dequant, int8_mm_dequant; CUDA kernels
// kInt8VectorQuant and kdequant_mm_int32_fp16), and the mixed-precision matmul of
// Linear8bitLt built from them.
//
// Quantize a [rows, cols] tensor (read as fp16, as bnb casts it), with threshold t >= 0:
//   outlier columns  the columns where any |x| >= t (t > 0 only), ascending;
//   absmax[r]        max |x| over row r's values with |x| < t (all values when t = 0), fp32 (bnb's
//                    SCA for activations, SCB for weights);
//   codes[r, c]      round-half-even(x * (127 * (1 / absmax[r]))) as int8, computed in fp32; 0 for
//                    |x| >= t and, when there is more than one row, in every outlier column.
// Dequantize: codes * absmax * (1/127), fp32.
// Mixed-precision matmul of activations A [m, k] and a quantized weight (CB [n, k], SCB [n]):
//   int8 part     acc = CA CB^T in int32, out = fp16(acc * SCA[i] * SCB[j] * (1/127^2) + bias[j])
//                 (bnb's kernel: one fused multiply-add with its constant 6.200012e-05f);
//   outliers      out += A[:, cols] dequantize(CB)[:, cols]^T, in A's dtype, the products
//                 summed in fp32 and rounded once (cuBLAS addmm);
//   the result is in A's dtype (through fp16 for the int8 part, as bnb).
//
// Where it runs: the same torch operations on every device (round-half-even and the fp32
// products are IEEE on both); the int32 product is at::_int_mm on CUDA (int8 tensor cores) and an
// exact float64 product on the CPU. bnb's kernel takes 127 / absmax with the GPU's approximate
// division; where x * scale lands within an fp32 step of a .5 a code could differ by one (none do
// in the fixture bnb-8bit-reference.safetensors).
#include <torch/types.h>

namespace qtrain::qat {

struct Int8Rows {
  torch::Tensor codes;         // int8 [rows, cols]
  torch::Tensor absmax;        // fp32 [rows]
  torch::Tensor outlier_cols;  // int64 [outliers], ascending; empty with threshold 0 or no outlier
};

// `input`: floating point [rows, cols] (or [..., cols], flattened to rows); threshold >= 0.
Int8Rows int8_vectorwise_quantize(const torch::Tensor& input, double threshold);
// codes [rows, cols] * absmax [rows] / 127 in fp32.
torch::Tensor int8_vectorwise_dequantize(const torch::Tensor& codes, const torch::Tensor& absmax);

// The LLM.int8 product of `input` [..., k] with the weight (codes [n, k] int8, absmax [n] fp32),
// plus `bias` [n] when defined: [..., n] in input's dtype. threshold 0: no outlier decomposition.
torch::Tensor int8_mixed_matmul(const torch::Tensor& input, const torch::Tensor& weight_codes,
                                const torch::Tensor& weight_absmax, const torch::Tensor& bias, double threshold);

}  // namespace qtrain::qat
