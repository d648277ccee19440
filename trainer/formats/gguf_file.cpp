#include "trainer/formats/gguf_file.h"

#include <array>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "trainer/base/file_system.h"

namespace qtrain::trainer {

namespace {

constexpr std::array<char, 4> kMagic = {'G', 'G', 'U', 'F'};
constexpr const char* kAlignmentKey = "general.alignment";
constexpr int64_t kMaxDims = 4;  // GGML_MAX_DIMS

uint64_t align_up(uint64_t offset, uint64_t alignment) { return (offset + alignment - 1) / alignment * alignment; }

bool is_power_of_two(uint64_t value) { return value != 0 && (value & (value - 1)) == 0; }

// Bytes of one scalar of a fixed-size type; 0 for strings (variable) and arrays.
uint64_t fixed_size(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8: case GgufValueType::kInt8: case GgufValueType::kBool: return 1;
    case GgufValueType::kUint16: case GgufValueType::kInt16: return 2;
    case GgufValueType::kUint32: case GgufValueType::kInt32: case GgufValueType::kFloat32: return 4;
    case GgufValueType::kUint64: case GgufValueType::kInt64: case GgufValueType::kFloat64: return 8;
    default: return 0;
  }
}

class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable<T>::value, "plain values only");
    const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
    bytes_.insert(bytes_.end(), bytes, bytes + sizeof(T));
  }
  void put_string(const std::string& text) {
    put<uint64_t>(text.size());
    bytes_.insert(bytes_.end(), text.begin(), text.end());
  }
  void put_scalar(const GgufScalar& scalar) {
    std::visit(
        [this](const auto& value) {
          using T = std::decay_t<decltype(value)>;
          if constexpr (std::is_same<T, std::string>::value) {
            put_string(value);
          } else if constexpr (std::is_same<T, bool>::value) {
            put<uint8_t>(value ? 1 : 0);
          } else {
            put<T>(value);
          }
        },
        scalar);
  }
  void pad_to(uint64_t alignment) { bytes_.resize(align_up(bytes_.size(), alignment), 0); }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

// Reads the file's bytes front to back; every read is checked against what is left.
class ByteReader {
 public:
  ByteReader(const std::vector<uint8_t>& bytes, const std::string& source) : bytes_(bytes), source_(source) {}

  uint64_t position() const { return position_; }
  uint64_t remaining() const { return bytes_.size() - position_; }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorCode::kWeights, source_ + ": " + what + " (at byte " + std::to_string(position_) + " of " +
                std::to_string(bytes_.size()) + "; is this a complete GGUF file?)");
  }

  template <typename T>
  T get(const std::string& what) {
    if (remaining() < sizeof(T)) fail("the file ends inside " + what);
    T value;
    std::memcpy(&value, bytes_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }

  std::string get_string(const std::string& what) {
    const auto length = get<uint64_t>(what + "'s length");
    if (length > remaining()) fail(what + " claims " + std::to_string(length) + " bytes, more than the file has left");
    std::string text(reinterpret_cast<const char*>(bytes_.data() + position_), static_cast<size_t>(length));
    position_ += length;
    return text;
  }

  GgufScalar get_scalar(GgufValueType type, const std::string& what) {
    switch (type) {
      case GgufValueType::kUint8: return get<uint8_t>(what);
      case GgufValueType::kInt8: return get<int8_t>(what);
      case GgufValueType::kUint16: return get<uint16_t>(what);
      case GgufValueType::kInt16: return get<int16_t>(what);
      case GgufValueType::kUint32: return get<uint32_t>(what);
      case GgufValueType::kInt32: return get<int32_t>(what);
      case GgufValueType::kFloat32: return get<float>(what);
      case GgufValueType::kBool: {
        const auto value = get<uint8_t>(what);
        if (value > 1) fail(what + ": a bool must be 0 or 1, found " + std::to_string(value));
        return value == 1;
      }
      case GgufValueType::kString: return get_string(what);
      case GgufValueType::kUint64: return get<uint64_t>(what);
      case GgufValueType::kInt64: return get<int64_t>(what);
      case GgufValueType::kFloat64: return get<double>(what);
      default: fail(what + ": value type " + std::to_string(static_cast<uint32_t>(type)) + " is not a scalar type");
    }
  }

  GgufValueType get_type(const std::string& what) {
    const auto id = get<uint32_t>(what + "'s type");
    if (id > static_cast<uint32_t>(GgufValueType::kFloat64)) {
      fail(what + ": unknown value type " + std::to_string(id) + " (GGUF v3 has 0..12)");
    }
    return static_cast<GgufValueType>(id);
  }

  GgufValue get_value(const std::string& key) {
    const auto type = get_type(key);
    if (type != GgufValueType::kArray) return GgufValue(get_scalar(type, key));
    const auto element_type = get_type(key + "'s elements");
    if (element_type == GgufValueType::kArray) fail(key + ": arrays of arrays are not supported");
    const auto count = get<uint64_t>(key + "'s element count");
    // Each element takes at least its fixed size (a string at least its 8-byte length), so a
    // count the file cannot hold is refused before anything is allocated.
    const uint64_t smallest = element_type == GgufValueType::kString ? 8 : fixed_size(element_type);
    if (count > remaining() / smallest) {
      fail(key + ": an array of " + std::to_string(count) + " elements does not fit in the rest of the file");
    }
    std::vector<GgufScalar> elements;
    elements.reserve(static_cast<size_t>(count));
    for (uint64_t index = 0; index < count; ++index) elements.push_back(get_scalar(element_type, key));
    return GgufValue::array(element_type, std::move(elements));
  }

 private:
  const std::vector<uint8_t>& bytes_;
  const std::string& source_;
  uint64_t position_ = 0;
};

}  // namespace

GgufValueType gguf_scalar_type(const GgufScalar& scalar) {
  // The alternatives are in id order, with kArray (9) left out between kString and kUint64.
  const auto index = static_cast<uint32_t>(scalar.index());
  return static_cast<GgufValueType>(index < 9 ? index : index + 1);
}

GgufValue GgufValue::array(GgufValueType element_type, std::vector<GgufScalar> elements) {
  for (const auto& element : elements) {
    if (gguf_scalar_type(element) != element_type) throw Error(ErrorCode::kInternal, "a GGUF array mixes element types");
  }
  GgufValue value;
  value.is_array = true;
  value.element_type = element_type;
  value.elements = std::move(elements);
  return value;
}

GgufValue GgufValue::strings(const std::vector<std::string>& values) {
  return array(GgufValueType::kString, std::vector<GgufScalar>(values.begin(), values.end()));
}

GgufValue GgufValue::int32s(const std::vector<int32_t>& values) {
  return array(GgufValueType::kInt32, std::vector<GgufScalar>(values.begin(), values.end()));
}

GgufValue GgufValue::float32s(const std::vector<float>& values) {
  return array(GgufValueType::kFloat32, std::vector<GgufScalar>(values.begin(), values.end()));
}

uint64_t gguf_tensor_bytes(qat::GgufBlockType type, const std::vector<int64_t>& shape, const std::string& name) {
  const auto& info = qat::gguf_block_format(type);
  if (shape.empty() || shape.back() % info.block_elements != 0) {
    throw Error(ErrorCode::kWeights, "GGUF tensor '" + name + "' of shape " + shape_text(shape) + ": " + info.name +
                " needs a last dimension that is a multiple of " + std::to_string(info.block_elements));
  }
  // Overflow-checked product (shapes come from files too).
  uint64_t elements = 1;
  for (const auto size : shape) {
    if (size < 0) throw Error(ErrorCode::kWeights, "GGUF tensor '" + name + "' has a negative dimension in " + shape_text(shape));
    if (size != 0 && elements > (uint64_t{1} << 62) / static_cast<uint64_t>(size)) {
      throw Error(ErrorCode::kWeights, "GGUF tensor '" + name + "' of shape " + shape_text(shape) + " is impossibly large");
    }
    elements *= static_cast<uint64_t>(size);
  }
  return elements / static_cast<uint64_t>(info.block_elements) * static_cast<uint64_t>(info.block_bytes);
}

void write_gguf(const std::string& path, const std::vector<std::pair<std::string, GgufValue>>& metadata,
                const std::vector<GgufTensorSource>& tensors) {
  uint64_t alignment = kGgufDefaultAlignment;
  ByteWriter header;
  for (const char letter : kMagic) header.put<char>(letter);
  header.put<uint32_t>(kGgufVersion);
  header.put<uint64_t>(tensors.size());
  header.put<uint64_t>(metadata.size());
  for (const auto& [key, value] : metadata) {
    if (key == kAlignmentKey) {
      const auto* given = value.is_array ? nullptr : std::get_if<uint32_t>(&value.scalar);
      if (!given || !is_power_of_two(*given)) throw Error(ErrorCode::kInternal, path + ": " + key + " must be a u32 power of two");
      alignment = *given;
    }
    header.put_string(key);
    if (value.is_array) {
      header.put<uint32_t>(static_cast<uint32_t>(GgufValueType::kArray));
      header.put<uint32_t>(static_cast<uint32_t>(value.element_type));
      header.put<uint64_t>(value.elements.size());
      for (const auto& element : value.elements) header.put_scalar(element);
    } else {
      header.put<uint32_t>(static_cast<uint32_t>(gguf_scalar_type(value.scalar)));
      header.put_scalar(value.scalar);
    }
  }
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const auto& tensor : tensors) {
    if (tensor.shape.empty() || static_cast<int64_t>(tensor.shape.size()) > kMaxDims) {
      throw Error(ErrorCode::kInternal, path + ": tensor '" + tensor.name + "' has " + std::to_string(tensor.shape.size()) +
                  " dimensions; GGUF holds 1 to 4");
    }
    sizes.push_back(gguf_tensor_bytes(tensor.type, tensor.shape, tensor.name));
    header.put_string(tensor.name);
    header.put<uint32_t>(static_cast<uint32_t>(tensor.shape.size()));
    for (auto size = tensor.shape.rbegin(); size != tensor.shape.rend(); ++size) header.put<uint64_t>(*size);
    header.put<uint32_t>(qat::gguf_block_format(tensor.type).ggml_type);
    header.put<uint64_t>(offset);
    offset = align_up(offset + sizes.back(), alignment);
  }
  header.pad_to(alignment);

  AtomicFile file(path);
  file.write(header.bytes().data(), header.bytes().size());
  const std::vector<uint8_t> padding(alignment, 0);
  for (size_t index = 0; index < tensors.size(); ++index) {
    const auto bytes = tensors[index].bytes();
    if (bytes.size() != sizes[index]) {
      throw Error(ErrorCode::kInternal, path + ": tensor '" + tensors[index].name + "' gave " + std::to_string(bytes.size()) +
                  " bytes, its shape and type need " + std::to_string(sizes[index]));
    }
    file.write(bytes.data(), bytes.size());
    file.write(padding.data(), align_up(bytes.size(), alignment) - bytes.size());
  }
  file.commit();
}

GgufFile GgufFile::open(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  if (!stream) throw Error(ErrorCode::kFileSystem, path + ": cannot open");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>());
  return parse(std::move(bytes), path);
}

GgufFile GgufFile::parse(std::vector<uint8_t> bytes, const std::string& source) {
  GgufFile file;
  file.source_ = source;
  file.bytes_ = std::move(bytes);
  ByteReader reader(file.bytes_, file.source_);
  for (const char letter : kMagic) {
    if (reader.get<char>("the magic") != letter) reader.fail("not a GGUF file (it does not start with 'GGUF')");
  }
  file.version_ = reader.get<uint32_t>("the version");
  if (file.version_ != kGgufVersion) {
    reader.fail("GGUF version " + std::to_string(file.version_) + " is not supported (qtrain reads version 3)");
  }
  const auto tensor_count = reader.get<uint64_t>("the tensor count");
  const auto kv_count = reader.get<uint64_t>("the metadata count");
  // A key/value takes at least 8 (key length) + 4 (type) + 1 bytes, a tensor info 8 + 4 + 8 + 4 + 8.
  if (kv_count > reader.remaining() / 13) reader.fail(std::to_string(kv_count) + " metadata entries cannot fit the file");
  if (tensor_count > reader.remaining() / 32) reader.fail(std::to_string(tensor_count) + " tensors cannot fit the file");

  for (uint64_t index = 0; index < kv_count; ++index) {
    auto key = reader.get_string("a metadata key");
    if (file.metadata_index_.count(key)) reader.fail("metadata key '" + key + "' appears twice");
    auto value = reader.get_value(key);
    if (key == kAlignmentKey) {
      const auto* alignment = value.is_array ? nullptr : std::get_if<uint32_t>(&value.scalar);
      if (!alignment || !is_power_of_two(*alignment)) reader.fail(key + " must be a u32 power of two");
      file.alignment_ = *alignment;
    }
    file.metadata_index_[key] = file.metadata_.size();
    file.metadata_.emplace_back(std::move(key), std::move(value));
  }

  for (uint64_t index = 0; index < tensor_count; ++index) {
    GgufTensorInfo info;
    info.name = reader.get_string("a tensor name");
    if (file.tensor_index_.count(info.name)) reader.fail("tensor '" + info.name + "' appears twice");
    const auto dims = reader.get<uint32_t>("tensor '" + info.name + "''s dimension count");
    if (dims < 1 || dims > kMaxDims) {
      reader.fail("tensor '" + info.name + "' has " + std::to_string(dims) + " dimensions (GGUF holds 1 to 4)");
    }
    std::vector<int64_t> ne;
    for (uint32_t dim = 0; dim < dims; ++dim) {
      const auto size = reader.get<uint64_t>("tensor '" + info.name + "''s shape");
      if (size > (uint64_t{1} << 62)) reader.fail("tensor '" + info.name + "' has an impossible dimension");
      ne.push_back(static_cast<int64_t>(size));
    }
    info.shape.assign(ne.rbegin(), ne.rend());
    const auto type_id = reader.get<uint32_t>("tensor '" + info.name + "''s type");
    const auto* type = qat::gguf_block_format_by_id(type_id);
    if (!type) {
      std::string known;
      for (const auto& format : qat::gguf_block_formats()) known += (known.empty() ? "" : ", ") + std::string(format.name);
      reader.fail("tensor '" + info.name + "' has ggml type " + std::to_string(type_id) + ", which qtrain does not read (" +
                  known + ")");
    }
    info.type = type->type;
    info.offset = reader.get<uint64_t>("tensor '" + info.name + "''s offset");
    try {
      info.bytes = gguf_tensor_bytes(info.type, info.shape, info.name);
    } catch (const Error& error) {
      reader.fail(error.what());
    }
    file.tensor_index_[info.name] = file.tensors_.size();
    file.tensors_.push_back(std::move(info));
  }

  file.data_start_ = align_up(reader.position(), file.alignment_);
  const uint64_t data_bytes = file.bytes_.size() >= file.data_start_ ? file.bytes_.size() - file.data_start_ : 0;
  for (const auto& info : file.tensors_) {
    if (info.offset % file.alignment_ != 0) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + info.name + "' starts at offset " + std::to_string(info.offset) +
                  ", not a multiple of the alignment " + std::to_string(file.alignment_));
    }
    if (info.offset > data_bytes || info.bytes > data_bytes - info.offset) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + info.name + "' (" + std::to_string(info.bytes) + " bytes at offset " +
                  std::to_string(info.offset) + ") lies outside the data section of " + std::to_string(data_bytes) +
                  " bytes (the file is truncated or corrupt)");
    }
  }
  return file;
}

bool GgufFile::contains(const std::string& key) const { return metadata_index_.count(key) != 0; }

const GgufValue& GgufFile::value(const std::string& key) const {
  const auto found = metadata_index_.find(key);
  if (found == metadata_index_.end()) throw Error(ErrorCode::kWeights, source_ + ": metadata key '" + key + "' is missing");
  return metadata_[found->second].second;
}

const GgufTensorInfo& GgufFile::tensor(const std::string& name) const {
  const auto found = tensor_index_.find(name);
  if (found == tensor_index_.end()) throw Error(ErrorCode::kWeights, source_ + ": tensor '" + name + "' is missing");
  return tensors_[found->second];
}

std::vector<uint8_t> GgufFile::tensor_bytes(const std::string& name) const {
  const auto& info = tensor(name);
  const auto* begin = bytes_.data() + data_start_ + info.offset;
  return std::vector<uint8_t>(begin, begin + info.bytes);
}

}  // namespace qtrain::trainer
