#include "qat/gguf_block_format.h"

#include <cstring>

#include "kernels/error.h"
#include "qat/gguf_quants.h"

namespace qtrain::qat {

namespace {

constexpr int kQ4Offset = 8;  // Q4_0 stores q + 8 in a nibble

// llama.cpp's llama_ftype (llama.h) for general.file_type.
// A k-quant's file type is its _S mix, the one that keeps most tensors in the type.
enum LlamaFileType : uint32_t {
  kAllF32 = 0,
  kMostlyF16 = 1,
  kMostlyQ4_0 = 2,
  kMostlyQ4_1 = 3,
  kMostlyQ8_0 = 7,
  kMostlyQ5_0 = 8,
  kMostlyQ5_1 = 9,
  kMostlyQ2_K = 10,
  kMostlyQ3_K_S = 11,
  kMostlyQ4_K_S = 14,
  kMostlyQ5_K_S = 16,
  kMostlyQ6_K = 18,
  kMostlyBF16 = 32,
  kMostlyMXFP4_MoE = 38,  // the experts MXFP4, the other weights Q8_0
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
  namespace q = gguf_quants;
  // A float type: one element per block, no codes.
  auto values = [type](const char* name, uint32_t id, int64_t bytes, uint32_t file_type) {
    return GgufBlockFormat{type, name, id, 1, bytes, file_type, std::nullopt, nullptr, nullptr, nullptr, nullptr};
  };
  // A block type that only llama.cpp's quantizer fills (no codes a QAT layer stores exactly);
  // `integer_codes` where its grid is integers times scales (qat/gguf_grid.h).
  auto blocks = [type](const char* name, uint32_t id, int64_t elements, int64_t bytes, uint32_t file_type,
                       void (*quantize)(const float*, uint8_t*, int64_t), void (*dequantize)(const uint8_t*, float*, int64_t),
                       bool integer_codes = true) {
    return GgufBlockFormat{type,    name,        id,     elements, bytes, file_type, std::nullopt, nullptr, nullptr,
                           quantize, dequantize, integer_codes};
  };
  switch (type) {
    case GgufBlockType::kF32: return values("F32", 0, 4, kAllF32);
    case GgufBlockType::kF16: return values("F16", 1, 2, kMostlyF16);
    case GgufBlockType::kBF16: return values("BF16", 30, 2, kMostlyBF16);
    case GgufBlockType::kQ4_0:
      return {type, "Q4_0", 2, kGgufBlockElements, sizeof(GgufBlockQ4_0), kMostlyQ4_0,
              GgufBlockGrid{/*bits=*/4, /*symmetric=*/true, /*fp16_scales=*/true}, encode_q4_0, decode_q4_0,
              q::quantize_q4_0, q::dequantize_q4_0, /*integer_codes=*/true};
    case GgufBlockType::kQ4_1:
      return blocks("Q4_1", 3, kGgufBlockElements, q::kQ4_1Bytes, kMostlyQ4_1, q::quantize_q4_1, q::dequantize_q4_1);
    case GgufBlockType::kQ5_0:
      return blocks("Q5_0", 6, kGgufBlockElements, q::kQ5_0Bytes, kMostlyQ5_0, q::quantize_q5_0, q::dequantize_q5_0);
    case GgufBlockType::kQ5_1:
      return blocks("Q5_1", 7, kGgufBlockElements, q::kQ5_1Bytes, kMostlyQ5_1, q::quantize_q5_1, q::dequantize_q5_1);
    case GgufBlockType::kQ8_0:
      return {type, "Q8_0", 8, kGgufBlockElements, sizeof(GgufBlockQ8_0), kMostlyQ8_0,
              GgufBlockGrid{/*bits=*/8, /*symmetric=*/true, /*fp16_scales=*/true}, encode_q8_0, decode_q8_0,
              q::quantize_q8_0, q::dequantize_q8_0, /*integer_codes=*/true};
    case GgufBlockType::kQ2_K:
      return blocks("Q2_K", 10, q::kSuperBlock, q::kQ2_KBytes, kMostlyQ2_K, q::quantize_q2_k, q::dequantize_q2_k);
    case GgufBlockType::kQ3_K:
      return blocks("Q3_K", 11, q::kSuperBlock, q::kQ3_KBytes, kMostlyQ3_K_S, q::quantize_q3_k, q::dequantize_q3_k);
    case GgufBlockType::kQ4_K:
      return blocks("Q4_K", 12, q::kSuperBlock, q::kQ4_KBytes, kMostlyQ4_K_S, q::quantize_q4_k, q::dequantize_q4_k);
    case GgufBlockType::kQ5_K:
      return blocks("Q5_K", 13, q::kSuperBlock, q::kQ5_KBytes, kMostlyQ5_K_S, q::quantize_q5_k, q::dequantize_q5_k);
    case GgufBlockType::kQ6_K:
      return blocks("Q6_K", 14, q::kSuperBlock, q::kQ6_KBytes, kMostlyQ6_K, q::quantize_q6_k, q::dequantize_q6_k);
    case GgufBlockType::kMXFP4:
      return blocks("MXFP4", 39, kGgufBlockElements, q::kMxfp4Bytes, kMostlyMXFP4_MoE, q::quantize_mxfp4, q::dequantize_mxfp4,
                    /*integer_codes=*/false);
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
