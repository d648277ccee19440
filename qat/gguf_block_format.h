#pragma once
// The tensor types a GGUF file holds, one row each, as ggml's type_traits (ggml.c) and llama.cpp's
// llama_ftype hold them: the type id a tensor-info records, the elements and bytes of one block
// (a float type's block is one element), the file type llama.cpp names a file mostly of this type,
// for the quantized types llama.cpp's quantizer and dequantizer (qat/gguf_quants.h), and for
// Q4_0 and Q8_0 (ggml-common.h), which QAT writes exactly, the codes a block stores and the
// functions that pack and unpack them. Free of LibTorch, so that the GGUF reader
// (trainer/formats/gguf_file.*) builds without it (its fuzz target does); qat/gguf_block.h
// encodes a QAT layer's tensors with these rows and tells which QuantSpec fits which type.
//
// A new type is one enumerator and one case of gguf_block_format.cpp's switch (the compiler
// refuses the switch until the case is there).
#include <cstdint>
#include <optional>
#include <vector>

namespace qtrain::qat {

// In the order of the rows (gguf_block_formats()); kCount is not a type but their number.
enum class GgufBlockType {
  kF32, kF16, kBF16,
  kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0,      // blocks of 32 (ggml's legacy types)
  kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K,      // super-blocks of 256 (k-quants)
  kMXFP4,                                 // blocks of 32, E8M0 scale, E2M1 codes (gpt-oss's experts)
  kCount
};

// The codes a quantized type stores exactly, as the QuantSpec fields they match
// (qat/gguf_block.h's gguf_block_fits): signed integer codes of `bits` bits, their group the
// block (block_elements), one scale per block and no second level above it. Float types have none.
struct GgufBlockGrid {
  int64_t bits;      // q in [-2^(bits-1), 2^(bits-1) - 1]: int4 [-8, 7], int8 [-128, 127]
  bool symmetric;    // no zero point: value = q * d
  bool fp16_scales;  // the block's scale d is stored as fp16
};

struct GgufBlockFormat {
  GgufBlockType type;
  const char* name;        // as gguf-py's GGMLQuantizationType names it: "F32", "Q4_0"
  uint32_t ggml_type;      // the id a GGUF tensor-info records (ggml.h's enum ggml_type)
  int64_t block_elements;  // 32 for Q4_0 / Q8_0 / MXFP4 (QK4_0, QK8_0, QK_MXFP4); 1 for float types
  int64_t block_bytes;     // sizeof the block struct (of one element for float types)
  uint32_t file_type;      // llama.cpp's llama_ftype of a file mostly of this type (general.file_type)
  std::optional<GgufBlockGrid> grid;  // quantized types only
  // Quantized types only (null for float types, whose bytes are the values themselves):
  // `blocks` blocks from their codes (block_elements each, row-major) and scales (one fp16 `d`
  // per block, as its bits) into `out` (blocks * block_bytes), and back. Lossless both ways.
  void (*encode)(const int8_t* codes, const uint16_t* scales, int64_t blocks, uint8_t* out);
  void (*decode)(const uint8_t* bytes, int64_t blocks, int8_t* codes, uint16_t* scales);
  // Quantized types only: llama.cpp's own quantizer without an importance matrix, `n` floats
  // (a multiple of block_elements) into n / block_elements blocks, byte for byte as
  // llama-quantize writes them; and ggml's dequantize_row_* back (qat/gguf_quants.h).
  void (*quantize)(const float* x, uint8_t* out, int64_t n);
  void (*dequantize)(const uint8_t* in, float* y, int64_t n);
  // The dequantization multiplies integer codes by scales (the legacy types and the K-quants):
  // qat/gguf_grid.h trains on that grid. MXFP4's codes stand for E2M1 values: no grid yet.
  bool integer_codes = false;
};

const GgufBlockFormat& gguf_block_format(GgufBlockType type);
// Every type, in enum order.
const std::vector<GgufBlockFormat>& gguf_block_formats();
// The row of an id read from a file, or nothing for types qtrain does not know.
const GgufBlockFormat* gguf_block_format_by_id(uint32_t ggml_type);

// general.file_type of a file holding tensors of `types` (not empty): the file type of its
// densest type (fewest bytes per element), which is the one llama.cpp's quantizer targeted when
// it wrote the file (the norms and other small tensors stay in a wider type).
uint32_t gguf_file_type(const std::vector<GgufBlockType>& types);

constexpr int64_t kGgufBlockElements = 32;  // ggml's QK4_0 and QK8_0

// ggml's structs; the fp16 d is kept as its bits.
struct GgufBlockQ4_0 {
  uint16_t d;
  uint8_t qs[kGgufBlockElements / 2];  // byte j: element j (low nibble), element j + 16 (high)
};
static_assert(sizeof(GgufBlockQ4_0) == sizeof(uint16_t) + kGgufBlockElements / 2, "wrong q4_0 block size/padding");

struct GgufBlockQ8_0 {
  uint16_t d;
  int8_t qs[kGgufBlockElements];
};
static_assert(sizeof(GgufBlockQ8_0) == sizeof(uint16_t) + kGgufBlockElements, "wrong q8_0 block size/padding");

}  // namespace qtrain::qat
