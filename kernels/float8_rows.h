#pragma once
// Row-wise FP8 (e4m3) quantization for the FP8 base's matmuls (qat/float8_matmul.h): each row of
// a [rows, columns] tensor gets its own scale, so one outlier token costs only its own row's
// resolution. One CUDA block per row reads the row once into registers (rows up to 32,768 bf16
// values in whole 16-byte vectors; others twice), its absmax then its codes, in one kernel where
// torch operations take four and an fp32 copy.
//
// The arithmetic, which qat/float8_codec.cpp's torch-operation reference repeats step for step so
// that both give the same bytes:
//     v[j]     = fp32(x[j]) * column_scale[j]         (column_scale absent: 1)
//     scale    = max(max_j |v[j]|, 1e-12) / 448       (fp32; 448 = e4m3's largest finite value)
//     codes[j] = e4m3(clamp(v[j] / scale, -448, 448))  (round to nearest even, as c10's cast)
// so v[j] ~= codes[j] * scale.
#include <ATen/core/Tensor.h>

#include <utility>

namespace qtrain::kernels {

// input [rows, columns] (contiguous; fp32, fp16 or bf16), column_scale fp32 [columns] or undefined
// -> (codes float8_e4m3fn [rows, columns], scales fp32 [rows, 1]).
std::pair<at::Tensor, at::Tensor> quantize_rows_float8_cuda(const at::Tensor& input, const at::Tensor& column_scale);

// codes [rows, columns] (contiguous float8_e4m3fn) -> its transpose [columns, rows], contiguous:
// the layout FP8 tensor cores read a right operand in (one tiled kernel; torch's copy of a
// transposed 1-byte tensor takes several times longer).
at::Tensor transpose_float8_cuda(const at::Tensor& codes);

// Whether the GPU `device_index` (-1: the current one) has FP8 tensor cores that torch's scaled
// matmul drives (compute capability 8.9: Ada, or 9.0: Hopper, and later).
bool float8_tensor_cores(int device_index);

}  // namespace qtrain::kernels
