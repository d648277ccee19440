#pragma once
// The GGUF file format, version 3 (ggml-org/ggml docs/gguf.md, gguf-py is the reference reader),
// written and read at the edge. All numbers little-endian:
//
//   u32 magic "GGUF" (the bytes 'G' 'G' 'U' 'F'), u32 version = 3, u64 tensor_count, u64 kv_count
//   kv_count x   key (string), u32 value type, value
//                  string = u64 byte length + UTF-8 bytes (no terminator)
//                  array  = u32 element type, u64 count, the elements
//   tensor_count x  name (string), u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset
//                  ne in ggml order: ne[0] is the innermost (last torch) dimension; the offset
//                  counts from the start of the data section and is a multiple of the alignment
//   padding to `general.alignment` (a u32 key, 32 when absent), then the data section: every
//   tensor's bytes, each padded to the alignment.
//
// A file is read whole and checked as it is parsed: a truncated file, an impossible count or
// length, an unknown type or a tensor outside the data section is an Error naming the file
// and the key or tensor, never a crash or an allocation the file's size does not justify.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kernels/error.h"
#include "qat/gguf_block_format.h"

namespace qtrain::trainer {

// The metadata value types, with their ids in the file.
enum class GgufValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6, kBool = 7,
  kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};

// One scalar; the alternative says its type (gguf_scalar_type).
using GgufScalar = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
                                uint64_t, int64_t, double>;
GgufValueType gguf_scalar_type(const GgufScalar& scalar);

// A metadata value: a scalar, or an array of scalars of one type.
struct GgufValue {
  GgufScalar scalar;                  // when !is_array
  bool is_array = false;
  GgufValueType element_type = GgufValueType::kUint8;  // arrays only
  std::vector<GgufScalar> elements;   // arrays only, each of element_type

  GgufValue() = default;
  // Any scalar alternative (uint32_t, float, std::string, ...; spell strings as std::string):
  // implicit, so that tables of keys read {"llama.block_count", uint32_t{32}}.
  template <typename T, typename = std::enable_if_t<std::is_constructible<GgufScalar, T>::value &&
                                                    !std::is_same<std::decay_t<T>, GgufValue>::value &&
                                                    !std::is_same<std::decay_t<T>, const char*>::value>>
  GgufValue(T&& value) : scalar(std::forward<T>(value)) {}  // NOLINT(google-explicit-constructor)
  static GgufValue array(GgufValueType element_type, std::vector<GgufScalar> elements);
  static GgufValue strings(const std::vector<std::string>& values);
  static GgufValue int32s(const std::vector<int32_t>& values);
  static GgufValue float32s(const std::vector<float>& values);

  // The scalar as T; an Error naming `key` when the value has another type (or is an array).
  template <typename T>
  const T& as(const std::string& key) const;
  // An array's elements as T; Error naming `key` otherwise.
  template <typename T>
  std::vector<T> array_as(const std::string& key) const;
};

// Bytes of a tensor of `shape` in `type` (the types a tensor-info records, their ids and block
// sizes, are the rows of qat/gguf_block_format.h); Error when the last dimension is not whole blocks.
uint64_t gguf_tensor_bytes(qat::GgufBlockType type, const std::vector<int64_t>& shape, const std::string& name);

// One tensor to write: its torch shape (row-major; the file records it reversed), its type and
// a function giving its bytes (called once, while writing, so a writer holds one tensor at a time).
struct GgufTensorSource {
  std::string name;
  std::vector<int64_t> shape;
  qat::GgufBlockType type = qat::GgufBlockType::kF32;
  std::function<std::vector<uint8_t>()> bytes;
};

constexpr uint32_t kGgufVersion = 3;
constexpr uint32_t kGgufDefaultAlignment = 32;

// Writes a GGUF v3 file: the metadata in the given order (`general.alignment`, when present,
// must be a u32 power of two; otherwise 32), then the tensors in the given order. Written to
// PATH.tmp and renamed into place. Errors name the path and the tensor.
void write_gguf(const std::string& path, const std::vector<std::pair<std::string, GgufValue>>& metadata,
                const std::vector<GgufTensorSource>& tensors);

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // torch order (the file's ne reversed)
  qat::GgufBlockType type = qat::GgufBlockType::kF32;
  uint64_t offset = 0;         // in the data section
  uint64_t bytes = 0;
};

// A GGUF file read whole into memory and checked (see above).
class GgufFile {
 public:
  static GgufFile open(const std::string& path);
  // The same from bytes in memory; `source` names them in errors (a fuzz target's entry).
  static GgufFile parse(std::vector<uint8_t> bytes, const std::string& source);

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  bool contains(const std::string& key) const;
  const GgufValue& value(const std::string& key) const;  // Error naming the file and key if absent
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo& tensor(const std::string& name) const;  // Error naming it if absent
  std::vector<uint8_t> tensor_bytes(const std::string& name) const;

 private:
  std::string source_;
  std::vector<uint8_t> bytes_;
  uint32_t version_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_start_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::map<std::string, size_t> metadata_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

template <typename T>
const T& GgufValue::as(const std::string& key) const {
  const T* value = is_array ? nullptr : std::get_if<T>(&scalar);
  if (!value) throw Error(ErrorCode::kWeights, key + ": the GGUF value has another type than expected");
  return *value;
}

template <typename T>
std::vector<T> GgufValue::array_as(const std::string& key) const {
  if (!is_array) throw Error(ErrorCode::kWeights, key + ": expected a GGUF array, found a single value");
  std::vector<T> values;
  values.reserve(elements.size());
  for (const auto& element : elements) {
    const T* value = std::get_if<T>(&element);
    if (!value) throw Error(ErrorCode::kWeights, key + ": the GGUF array's elements have another type than expected");
    values.push_back(*value);
  }
  return values;
}

}  // namespace qtrain::trainer
