#pragma once
// GGUF's symmetric block formats Q4_0 and Q8_0 (llama.cpp, ggml-common.h / ggml-quants.c), the
// bytes of one tensor's data. A tensor's elements are taken in row-major order (ggml's ne0 is
// the last dimension, which must be a multiple of 32) in blocks of 32, each stored as
//
//   Q4_0  fp16 d, then 16 bytes: byte j holds element j in its low nibble and element j + 16 in
//         its high nibble, each as q + 8 in [0, 15];        value = (nibble - 8) * d
//   Q8_0  fp16 d, then 32 int8 q;                            value = q * d
//
// d is little-endian IEEE half. These are exactly QuantSpec::gguf_q4_0() / gguf_q8_0() codes
// (q in [-8, 7] / [-128, 127], z = 0, one fp16-exact scale per group of 32), so encoding is
// lossless: the file dequantizes (in fp32, as llama.cpp's dequantize_row_q4_0 / _q8_0 do) to the
// fake-quant weights bit for bit. How we choose q and d need not match llama.cpp's quantizer;
// only the layout and the dequantization formula do.
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"
#include "qat/quantize.h"

namespace qtrain::qat {

// Whether the quantized type of `format` holds codes of `spec` exactly: its grid's integer
// width and symmetry, groups of one block, fp16 scales, one level of them.
bool gguf_block_fits(const GgufBlockFormat& format, const QuantSpec& spec);

// The block type that holds tensors quantized with `spec` exactly; an Error naming `what` (the
// recipe key of the weights' spec) and why GGUF cannot hold the scheme otherwise.
GgufBlockType gguf_block_type_for(const QuantSpec& spec, const std::string& what);

// The tensor's data as GGUF stores it: blocks in row-major order. An Error naming `what` when
// its spec has no block type, its last dimension is not a multiple of 32, or a scale is not an
// fp16 value.
std::vector<uint8_t> encode_gguf_blocks(const QuantizedTensor& tensor, const std::string& what);

// The reference dequantization (llama.cpp's dequantize_row_*): fp32 tensor of `shape` from
// `bytes` (exactly numel / 32 blocks of a quantized `type`).
torch::Tensor decode_gguf_blocks(const std::vector<uint8_t>& bytes, GgufBlockType type, c10::IntArrayRef shape);

}  // namespace qtrain::qat
