#include "qat/gguf_block_format.h"

#include <array>

namespace qtrain::qat {

namespace {

const std::array<GgufBlockFormat, 2> kBlockFormats = {{
    {GgufBlockType::kQ4_0, "Q4_0", 2, kGgufBlockElements, sizeof(GgufBlockQ4_0), 4},
    {GgufBlockType::kQ8_0, "Q8_0", 8, kGgufBlockElements, sizeof(GgufBlockQ8_0), 8},
}};

}  // namespace

const GgufBlockFormat& gguf_block_format(GgufBlockType type) {
  return kBlockFormats[type == GgufBlockType::kQ4_0 ? 0 : 1];
}

}  // namespace qtrain::qat
