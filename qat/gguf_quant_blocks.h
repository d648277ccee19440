#pragma once
// The loop every GGUF quantizer and dequantizer of qat/gguf_quants.h shares: n values in blocks
// of `kElements` (32, or a k-quant's 256), each block one `Block` struct of ggml-common.h's
// layout, copied in and out with memcpy so that a buffer need not be aligned.
#include <cstdint>
#include <cstring>

namespace qtrain::qat::gguf_quants {

// n / kElements blocks from n floats: `fill(values, block)` quantizes one block's values.
template <typename Block, int64_t kElements, typename Fill>
void quantize_blocks(const float* x, uint8_t* out, int64_t n, Fill fill) {
  for (int64_t index = 0; index < n / kElements; ++index) {
    Block block{};
    fill(x + index * kElements, block);
    std::memcpy(out + index * sizeof(Block), &block, sizeof(Block));
  }
}

// n floats from n / kElements blocks: `expand(block, values)` writes one block's values.
template <typename Block, int64_t kElements, typename Expand>
void dequantize_blocks(const uint8_t* in, float* y, int64_t n, Expand expand) {
  for (int64_t index = 0; index < n / kElements; ++index) {
    Block block;
    std::memcpy(&block, in + index * sizeof(Block), sizeof(Block));
    expand(block, y + index * kElements);
  }
}

}  // namespace qtrain::qat::gguf_quants
