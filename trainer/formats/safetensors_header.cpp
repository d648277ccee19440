#include "trainer/formats/safetensors_header.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "kernels/error.h"
#include "trainer/base/dtype_names.h"

namespace qtrain::trainer {
namespace {

using nlohmann::json;

constexpr size_t kMaxDimensions = 64;

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::string offsets_string(const TensorInfo& info) {
  return "[" + std::to_string(info.begin) + ", " + std::to_string(info.end) + "]";
}

// Reads the header's JSON as a stream of SAX events straight into TensorInfo entries, so the
// memory it takes is that of the entries, whatever the header holds: nesting deeper than
// {entry: {field: [integers]}} or a shape of more than kMaxDimensions stops it at once.
class HeaderReader final : public json::json_sax_t {
 public:
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::string error;  // why the header was refused; empty when it was read

  bool null() override { return not_expected("null"); }
  bool boolean(bool) override { return not_expected("a boolean"); }
  bool number_integer(number_integer_t value) override {
    if (depth_ != 3) return not_expected("a number");
    if (value < 0) return fail_here("has a negative value " + std::to_string(value));
    return number_unsigned(static_cast<number_unsigned_t>(value));
  }
  bool number_unsigned(number_unsigned_t value) override {
    if (depth_ != 3) return not_expected("a number");
    auto& tensor = tensors.back();
    if (field_ == "shape") {
      if (value > static_cast<uint64_t>(INT64_MAX)) return fail_here("has a dimension too large for a tensor");
      if (tensor.shape.size() == kMaxDimensions) {
        return fail_here("has more than " + std::to_string(kMaxDimensions) + " dimensions");
      }
      tensor.shape.push_back(static_cast<int64_t>(value));
    } else {
      if (++offsets_count_ > 2) return fail_here("holds more than two values, expected two: [begin, end]");
      (offsets_count_ == 1 ? tensor.begin : tensor.end) = value;
    }
    return true;
  }
  bool number_float(number_float_t, const string_t& text) override {
    return depth_ == 3 ? fail_here("has " + text + ", which is not a non-negative integer") : not_expected("a number");
  }
  bool string(string_t& value) override {
    if (depth_ == 2 && in_metadata_) {
      metadata[key_] = value;
      return true;
    }
    if (depth_ == 2 && field_ == "dtype") {
      tensors.back().dtype = value;
      return true;
    }
    return not_expected("a string");
  }
  bool binary(binary_t&) override { return not_expected("binary data"); }

  bool start_object(std::size_t) override {
    if (depth_ == 0) {
      depth_ = 1;
      return true;
    }
    if (depth_ != 1) return not_expected("an object");
    ++depth_;
    if (key_ == kSafetensorsMetadataKey) {
      if (metadata_seen_) return fail("'__metadata__' appears twice");
      metadata_seen_ = in_metadata_ = true;
      return true;
    }
    if (!names_.insert(key_).second) return fail("tensor '" + key_ + "' appears twice");
    tensors.push_back(TensorInfo{key_, "", {}, 0, 0});
    fields_.clear();
    field_.clear();
    offsets_count_ = 0;
    return true;
  }
  bool key(string_t& value) override {
    if (depth_ == 1) {
      key_ = value;
    } else if (in_metadata_) {
      key_ = value;
    } else {
      field_ = value;
      if (field_ != "dtype" && field_ != "shape" && field_ != "data_offsets") {
        return fail("tensor '" + tensors.back().name + "' has an unknown field '" + field_ +
                    "' (expected dtype, shape and data_offsets)");
      }
      if (!fields_.insert(field_).second) return fail_here("appears twice");
    }
    return true;
  }
  bool end_object() override {
    if (--depth_ == 1) {
      if (in_metadata_) {
        in_metadata_ = false;
        key_ = kSafetensorsMetadataKey;  // so that an error after it does not name the last metadata key
      } else if (fields_.size() != 3) {
        return fail("tensor '" + tensors.back().name + "' lacks one of dtype, shape and data_offsets");
      } else if (offsets_count_ != 2) {
        return fail("tensor '" + tensors.back().name + "' data_offsets holds " + std::to_string(offsets_count_) +
                    " values, expected two: [begin, end]");
      }
    }
    return true;
  }
  bool start_array(std::size_t) override {
    if (depth_ != 2 || in_metadata_ || field_ == "dtype") return not_expected("an array");
    ++depth_;
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& exception) override {
    // nlohmann's text reads "[json.exception.parse_error.101] parse error at line 1, column 9: ..."
    std::string what = exception.what();
    const auto bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    return fail("the header is not valid JSON (" + what + ")");
  }

 private:
  bool fail(const std::string& message) {
    error = message;
    return false;
  }
  // An error about the value now being read, named by where it sits.
  bool fail_here(const std::string& message) {
    if (depth_ >= 2 && !in_metadata_) return fail("tensor '" + tensors.back().name + "' " + field_ + " " + message);
    return fail(message);
  }
  bool not_expected(const std::string& what) {
    if (depth_ == 0) return fail("the header is " + what + ", not a JSON object of tensors");
    if (depth_ == 1) return fail("entry '" + key_ + "' is " + what + ", not an object");
    if (in_metadata_) return fail("__metadata__ value of '" + key_ + "' is " + what + ", not a string");
    if (field_ == "dtype") return fail_here("is " + what + ", not a string such as \"BF16\"");
    if (depth_ == 2) return fail_here("is " + what + ", not an array of non-negative integers");
    return fail_here("holds " + what + " where a non-negative integer belongs");
  }

  int depth_ = 0;      // objects and arrays open: root 1, entry 2, shape / data_offsets 3
  std::string key_;    // the root's key being read (tensor name or __metadata__), or the metadata key
  std::string field_;  // the tensor field being read
  std::set<std::string> fields_;
  std::set<std::string> names_;
  size_t offsets_count_ = 0;
  bool in_metadata_ = false;
  bool metadata_seen_ = false;
};

// Checks each tensor's dtype, shape and byte count, then that their data_offsets tile the data
// section exactly, in order, as the reference implementation demands; sorts them by offset.
void check_tensors(const std::string& path, std::vector<TensorInfo>& tensors, uint64_t data_bytes) {
  for (const auto& info : tensors) {
    const std::string where = path + ": tensor '" + info.name + "'";
    const auto dtype = safetensors_dtype(info.dtype);
    if (!dtype) {
      throw Error(ErrorCode::kWeights, where + " has dtype '" + info.dtype + "', which qtrain cannot read (it reads " +
                  safetensors_dtype_names() + ")");
    }
    uint64_t bytes = static_cast<uint64_t>(dtype->element_size());
    for (const int64_t dim : info.shape) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) {
        throw Error(ErrorCode::kWeights, where + " has shape " + shape_string(info.shape) + ", larger than any file: the header is damaged");
      }
    }
    if (info.end < info.begin) {
      throw Error(ErrorCode::kWeights, where + " data_offsets " + offsets_string(info) + " end before they begin: the header is damaged");
    }
    if (info.end - info.begin != bytes) {
      throw Error(ErrorCode::kWeights, where + " has shape " + shape_string(info.shape) + " of " + info.dtype + ", " +
                  std::to_string(bytes) + " bytes, but its data_offsets " + offsets_string(info) + " hold " +
                  std::to_string(info.end - info.begin) + ": the header is damaged");
    }
  }
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected_begin = 0;
  const TensorInfo* previous = nullptr;
  for (const auto& info : tensors) {
    const std::string where = path + ": tensor '" + info.name + "' data_offsets " + offsets_string(info);
    if (info.begin < expected_begin) {
      throw Error(ErrorCode::kWeights, where + " overlap those of tensor '" + previous->name + "' " + offsets_string(*previous) +
                  ": the header is damaged");
    }
    if (info.begin > expected_begin) {
      throw Error(ErrorCode::kWeights, where + " leave bytes [" + std::to_string(expected_begin) + ", " + std::to_string(info.begin) +
                  ") of the data section to no tensor, but safetensors packs tensors back to back: the header is "
                  "damaged");
    }
    if (info.end > data_bytes) {
      throw Error(ErrorCode::kWeights, where + " end past the file's data section (" + std::to_string(data_bytes) +
                  " bytes): the file is truncated or damaged");
    }
    expected_begin = info.end;
    previous = &info;
  }
  if (expected_begin != data_bytes) {
    throw Error(ErrorCode::kWeights, path + ": the data section has " + std::to_string(data_bytes) + " bytes but its tensors end at byte " +
                std::to_string(expected_begin) + ": the file has trailing bytes or a damaged header");
  }
}

}  // namespace

SafetensorsHeader read_safetensors_header(const std::string& path, const unsigned char* bytes, uint64_t file_bytes) {
  if (file_bytes < 8) {
    throw Error(ErrorCode::kWeights, path + ": " + std::to_string(file_bytes) +
                " bytes, too short for a safetensors header: the file is truncated or not a safetensors file");
  }
  SafetensorsHeader header;
  for (int i = 7; i >= 0; --i) header.header_bytes = (header.header_bytes << 8) | bytes[i];
  if (header.header_bytes > kSafetensorsMaxHeaderBytes) {
    throw Error(ErrorCode::kWeights, path + ": header length " + std::to_string(header.header_bytes) +
                " bytes is over the 100 MB safetensors allows: the file is damaged or not a safetensors file");
  }
  if (header.header_bytes > file_bytes - 8) {
    throw Error(ErrorCode::kWeights, path + ": header length " + std::to_string(header.header_bytes) +
                " bytes runs past the end of the file (" + std::to_string(file_bytes) +
                " bytes): the file is truncated or not a safetensors file");
  }

  const auto* header_begin = reinterpret_cast<const char*>(bytes + 8);
  HeaderReader reader;
  bool parsed = false;
  try {
    parsed = json::sax_parse(header_begin, header_begin + header.header_bytes, &reader);
  } catch (const json::exception& exception) {
    reader.error = std::string("the header is not valid JSON (") + exception.what() + ")";
  }
  if (!parsed) {
    throw Error(ErrorCode::kWeights,
                path + ": " + (reader.error.empty() ? "the header is not a safetensors header" : reader.error) +
                    ": the file is damaged or not a safetensors file");
  }
  check_tensors(path, reader.tensors, file_bytes - 8 - header.header_bytes);
  header.tensors = std::move(reader.tensors);
  header.metadata = std::move(reader.metadata);
  return header;
}

}  // namespace qtrain::trainer
