#pragma once
// GGUF's block formats Q4_0 and Q8_0 as data (llama.cpp's ggml-common.h): the type ids a
// tensor-info records, the elements and bytes of one block, and the block structs. Free of
// LibTorch, so that the GGUF reader (trainer/gguf_file.*) builds without it (its fuzz target
// does); qat/gguf_block.h encodes and decodes the blocks.
#include <cstdint>

namespace qtrain::qat {

enum class GgufBlockType { kQ4_0, kQ8_0 };

struct GgufBlockFormat {
  GgufBlockType type;
  const char* name;        // "Q4_0", as gguf-py's GGMLQuantizationType names it
  uint32_t ggml_type;      // the type id a GGUF tensor-info records (ggml_type enum)
  int64_t block_elements;  // 32
  int64_t block_bytes;     // sizeof the block struct
  int64_t bits;            // of each q
};

const GgufBlockFormat& gguf_block_format(GgufBlockType type);

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
