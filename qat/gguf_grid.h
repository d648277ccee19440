#pragma once
// Quantization-aware training on llama.cpp's GGUF block types: a weight rounded onto a type's grid
// with tensor ops (any device), every level of the grid kept as the block stores it, so that the
// GGUF export of a run dequantizes bit for bit to the weights of its last forward.
//
// A type's grid (ggml-common.h, ggml-quants.c's dequantize_row_*), with q the integer the
// dequantization multiplies and the block storing q + an offset:
//
//   Q4_0 Q5_0 Q8_0   blocks of 32, fp16 d:             value = d * q
//   Q4_1 Q5_1        blocks of 32, fp16 d and m:       value = (d * q) + m
//   Q3_K Q6_K        super-blocks of 256 in sub-blocks of 16, each with a signed integer scale sc,
//                    one fp16 d:                        value = (d * sc) * q
//   Q2_K Q4_K Q5_K   super-blocks of 256 in sub-blocks of 16 (Q2_K) or 32, each with an integer
//                    scale sc and min mc, fp16 d, dmin: value = (d * sc) * q - (dmin * mc)
//
// Every product there is exact in fp32 (an fp16 d has at most 11 significant bits and the integer
// sc * q at most 12, Q6_K's |sc| <= 128 times |q| <= 32), so a value is the exact d * sc * q, rounded
// once where m is added or dmin * mc subtracted, whatever the order of the products and whether a
// compiler fuses the last step into a multiply-add. dequantize_gguf_grid computes it with
// elementwise fp32 tensor ops (no reductions), so it equals gguf-py's `gguf.quants.dequantize` and
// ggml's dequantize_row_* of the exported bytes on any device.
#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "qat/gguf_block_format.h"

namespace qtrain::qat {

// One [rows, cols] tensor on a quantized block type's grid (cols a multiple of the type's block:
// 32 for the legacy types, 256 for the k-quants), its numbers named as ggml-common.h's block
// structs name them and held as the blocks hold them. Undefined tensors are the ones the type
// does not have. Every tensor is on the weight's device.
struct GgufGridTensor {
  GgufBlockType type;
  torch::Tensor codes;   // [rows, cols], each element's code as the block stores it (q + the type's
                         // offset, unsigned: Q4_0 [0, 15], Q3_K [0, 7], Q6_K [0, 63]); uint8, int8 for Q8_0
  torch::Tensor scales;  // k-quants, [rows, cols / sub-block]: each sub-block's integer scale as
                         // stored; uint8 (Q2_K [0, 15], Q3_K sc + 32 in [0, 63], Q4_K Q5_K [0, 63]),
                         // int8 for Q6_K
  torch::Tensor mins;    // Q2_K Q4_K Q5_K, as `scales`: each sub-block's min code, uint8
  torch::Tensor d;       // [rows, cols / block], fp32 holding fp16 values: the block's (legacy) or
                         // super-block's (k-quants) scale
  torch::Tensor m;       // Q4_1 Q5_1, as `d`: the block's minimum (any sign)
  torch::Tensor dmin;    // Q2_K Q4_K Q5_K, as `d`: the scale of the mins, >= 0
};

struct GgufGridOptions {
  // Besides each (sub-)block's min/max scale, try five more (the codes of scales around it, each
  // refit by least squares) and one refit of the best one's codes, keeping the scale (and min) of
  // least squared error: an RMS error from 13% below llama.cpp's quantizer's to 0.2% above it (Q4_K),
  // for 10-17 times the time (1.4-1.7 s against 0.1 s for a [4096, 4096] weight on two CPU cores).
  // Off, the min/max scale alone: the legacy types' error equals llama.cpp's, the k-quants' is 1-11%
  // larger.
  bool search_scales = true;
};

// Rounds `weight` (fp32 [rows, cols], any device; no gradient flows) onto `type`'s grid: each
// (sub-)block's scale (and min) fit to its values (see GgufGridOptions), the k-quants' sub-block
// scales and mins quantized against an fp16 d (and dmin) as their blocks require, then each
// element's nearest code. Codes, scales and mins stay in their bit widths, d, m and dmin are fp16
// values (clamped to +-65504), dmin and the k-quants' mins are >= 0 (ggml's -dmin * mc offset), and
// an all-zero block dequantizes to zeros. Finite input gives finite values. The same fp32 values give
// the same grid, bit for bit, on the CPU and CUDA, with any thread count, memory layout and rows
// beside them: an export that recomputes on the CPU the grid of a CUDA forward gets that grid. Throws
// an Error naming the type when `weight` is not fp32 [rows, cols] with cols a multiple of the type's
// block, or the type is not quantized.
GgufGridTensor quantize_gguf_grid(const torch::Tensor& weight, GgufBlockType type, const GgufGridOptions& options = {});

// The nearest codes of `weight` on `grid`'s scales (its d, m, scales, mins and dmin kept): what a
// fake quantizer whose scales are frozen (or taken from llama.cpp's quantizer through
// decode_gguf_grid) computes in each forward; a handful of elementwise ops. `weight` has the
// grid's shape and device.
GgufGridTensor requantize_gguf_grid(const torch::Tensor& weight, const GgufGridTensor& grid);

// The fp32 values the grid stands for, exactly as gguf-py's numpy `gguf.quants.dequantize` and
// ggml's dequantize_row_* compute them from the exported bytes; [rows, cols] on the grid's device.
torch::Tensor dequantize_gguf_grid(const GgufGridTensor& grid);

// The tensor's data as a GGUF file stores it: its blocks in row-major order, each laid out as
// ggml-common.h's struct. Throws an Error when a code, scale or min is outside its bit width or a
// d, m or dmin is not an fp16 value (a grid not made by this file).
std::vector<uint8_t> encode_gguf_grid(const GgufGridTensor& grid);

// encode_gguf_grid's inverse: the grid of `rows` x `cols` values in `bytes` (as llama.cpp's
// quantizer or a GGUF file holds them), on the CPU. encode_gguf_grid gives the same bytes back
// (but a NaN d's payload). Throws an Error when the sizes do not match.
GgufGridTensor decode_gguf_grid(const std::vector<uint8_t>& bytes, GgufBlockType type, int64_t rows, int64_t cols);

}  // namespace qtrain::qat
