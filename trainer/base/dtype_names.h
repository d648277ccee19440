#pragma once
// The safetensors dtype names and the LibTorch scalar types they stand for, in one table
// (the names are those of the reference implementation, huggingface/safetensors).
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

namespace qtrain::trainer {

struct SafetensorsDtype {
  const char* name;  // as written in a safetensors header: "BF16", "F8_E4M3", ...
  c10::ScalarType scalar_type;
  // Bytes per element, the same on disk (little-endian, packed) as in a LibTorch tensor.
  int64_t element_size() const { return static_cast<int64_t>(c10::elementSize(scalar_type)); }
};

// The entry for a header's dtype name, or nothing when qtrain cannot hold it in a tensor
// (sub-byte formats such as F4 / F6_E2M3, or a name that is not a safetensors dtype).
std::optional<SafetensorsDtype> safetensors_dtype(const std::string& name);

// The entry for a tensor's scalar type, or nothing when safetensors has no name for it
// (quantized and complex-double types, for instance).
std::optional<SafetensorsDtype> safetensors_dtype(c10::ScalarType scalar_type);

// "F64, F32, F16, ..." for error messages.
std::string safetensors_dtype_names();

}  // namespace qtrain::trainer
