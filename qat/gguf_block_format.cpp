#include "qat/gguf_block_format.h"

#include <cstring>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

constexpr int kQ4Offset = 8;  // Q4_0 stores q + 8 in a nibble

// llama.cpp's llama_ftype (llama.h) for general.file_type.
enum LlamaFileType : uint32_t {
  kAllF32 = 0,
  kMostlyF16 = 1,
  kMostlyQ4_0 = 2,
  kMostlyQ8_0 = 7,
  kMostlyBF16 = 32,
};

// The blocks of llama.cpp's `Block` (an fp16 scale d, then qs) for `blocks` blocks of 32 codes and
// their scales; `pack` writes one block's codes into qs.
template <typename Block, typename Pack>
void encode_blocks(const int8_t* codes, const uint16_t* scales, int64_t blocks, uint8_t* out, Pack pack) {
  for (int64_t block = 0; block < blocks; ++block) {
    Block packed{};
    packed.d = scales[block];
    pack(codes + block * kGgufBlockElements, packed.qs);
    std::memcpy(out + block * sizeof(packed), &packed, sizeof(packed));
  }
}

// encode_blocks' inverse: `unpack` reads one block's qs into its 32 codes.
template <typename Block, typename Unpack>
void decode_blocks(const uint8_t* bytes, int64_t blocks, int8_t* codes, uint16_t* scales, Unpack unpack) {
  for (int64_t block = 0; block < blocks; ++block) {
    Block packed;
    std::memcpy(&packed, bytes + block * sizeof(packed), sizeof(packed));
    scales[block] = packed.d;
    unpack(packed.qs, codes + block * kGgufBlockElements);
  }
}

void encode_q4_0(const int8_t* codes, const uint16_t* scales, int64_t blocks, uint8_t* out) {
  encode_blocks<GgufBlockQ4_0>(codes, scales, blocks, out, [](const int8_t* q, uint8_t* qs) {
    for (int64_t j = 0; j < kGgufBlockElements / 2; ++j) {
      const int low = q[j] + kQ4Offset;
      const int high = q[j + kGgufBlockElements / 2] + kQ4Offset;
      qs[j] = static_cast<uint8_t>(low | (high << 4));
    }
  });
}

void decode_q4_0(const uint8_t* bytes, int64_t blocks, int8_t* codes, uint16_t* scales) {
  decode_blocks<GgufBlockQ4_0>(bytes, blocks, codes, scales, [](const uint8_t* qs, int8_t* q) {
    for (int64_t j = 0; j < kGgufBlockElements / 2; ++j) {
      q[j] = static_cast<int8_t>((qs[j] & 0x0F) - kQ4Offset);
      q[j + kGgufBlockElements / 2] = static_cast<int8_t>((qs[j] >> 4) - kQ4Offset);
    }
  });
}

void encode_q8_0(const int8_t* codes, const uint16_t* scales, int64_t blocks, uint8_t* out) {
  encode_blocks<GgufBlockQ8_0>(codes, scales, blocks, out,
                               [](const int8_t* q, int8_t* qs) { std::memcpy(qs, q, kGgufBlockElements); });
}

void decode_q8_0(const uint8_t* bytes, int64_t blocks, int8_t* codes, uint16_t* scales) {
  decode_blocks<GgufBlockQ8_0>(bytes, blocks, codes, scales,
                               [](const int8_t* qs, int8_t* q) { std::memcpy(q, qs, kGgufBlockElements); });
}

// The row of each type. The switch has no default, and -Wswitch is an error here, so that a new
// enumerator does not compile until its row is written. Ids: ggml.h's enum ggml_type.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
GgufBlockFormat row_of(GgufBlockType type) {
  switch (type) {
    case GgufBlockType::kF32: return {type, "F32", 0, 1, 4, kAllF32, std::nullopt, nullptr, nullptr};
    case GgufBlockType::kF16: return {type, "F16", 1, 1, 2, kMostlyF16, std::nullopt, nullptr, nullptr};
    case GgufBlockType::kBF16: return {type, "BF16", 30, 1, 2, kMostlyBF16, std::nullopt, nullptr, nullptr};
    case GgufBlockType::kQ4_0:
      return {type, "Q4_0", 2, kGgufBlockElements, sizeof(GgufBlockQ4_0), kMostlyQ4_0,
              GgufBlockGrid{/*bits=*/4, /*symmetric=*/true, /*fp16_scales=*/true}, encode_q4_0, decode_q4_0};
    case GgufBlockType::kQ8_0:
      return {type, "Q8_0", 8, kGgufBlockElements, sizeof(GgufBlockQ8_0), kMostlyQ8_0,
              GgufBlockGrid{/*bits=*/8, /*symmetric=*/true, /*fp16_scales=*/true}, encode_q8_0, decode_q8_0};
    case GgufBlockType::kCount: break;
  }
  throw Error(ErrorCode::kInternal, "GGUF tensor type " + std::to_string(static_cast<int>(type)) + " has no row");
}
#pragma GCC diagnostic pop

// Whether a holds fewer bytes per element than b.
bool denser(const GgufBlockFormat& a, const GgufBlockFormat& b) {
  return a.block_bytes * b.block_elements < b.block_bytes * a.block_elements;
}

}  // namespace

const std::vector<GgufBlockFormat>& gguf_block_formats() {
  static const std::vector<GgufBlockFormat> rows = [] {
    std::vector<GgufBlockFormat> all;
    for (int index = 0; index < static_cast<int>(GgufBlockType::kCount); ++index) {
      all.push_back(row_of(static_cast<GgufBlockType>(index)));
    }
    return all;
  }();
  return rows;
}

const GgufBlockFormat& gguf_block_format(GgufBlockType type) {
  const auto index = static_cast<size_t>(type);
  if (index >= gguf_block_formats().size()) throw Error(ErrorCode::kInternal, "unknown GGUF tensor type");
  return gguf_block_formats()[index];
}

const GgufBlockFormat* gguf_block_format_by_id(uint32_t ggml_type) {
  for (const auto& format : gguf_block_formats()) {
    if (format.ggml_type == ggml_type) return &format;
  }
  return nullptr;
}

uint32_t gguf_file_type(const std::vector<GgufBlockType>& types) {
  if (types.empty()) throw Error(ErrorCode::kInternal, "a GGUF file without tensors has no file type");
  const GgufBlockFormat* densest = &gguf_block_format(types.front());
  for (const auto type : types) {
    if (denser(gguf_block_format(type), *densest)) densest = &gguf_block_format(type);
  }
  return densest->file_type;
}

}  // namespace qtrain::qat
