#pragma once
// The header of a safetensors file (the format is described in trainer/formats/safetensors.h), read
// from its bytes and checked completely: every tensor's dtype, shape and data_offsets, which
// must tile the data section exactly. Free of LibTorch: the parser a downloaded file meets
// first, built alone by the fuzz targets (tests/fuzz).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace qtrain::trainer {

// The reference implementation refuses larger headers; so does qtrain, before reading one.
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
constexpr const char* kSafetensorsMetadataKey = "__metadata__";

struct TensorInfo {
  std::string name;
  std::string dtype;  // safetensors name: F32, BF16, U8, ... (trainer/base/dtype_names.h)
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section, [begin, end)
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;          // N, the JSON's length; the data section starts at 8 + N
  std::vector<TensorInfo> tensors;    // by data offset
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// Reads the header of the safetensors file `path`, whose `file_bytes` bytes start at `bytes`
// (which may be null when file_bytes < 8). Error naming the file (and tensor) for a file too
// short, a header length past the end or over 100 MB, JSON that is not a safetensors header,
// an unknown dtype, or data_offsets that disagree with the shapes or do not tile the data.
SafetensorsHeader read_safetensors_header(const std::string& path, const unsigned char* bytes, uint64_t file_bytes);

}  // namespace qtrain::trainer
