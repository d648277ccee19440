#include "trainer/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>

#include "kernels/error.h"
#include "trainer/dtype_names.h"
#include "trainer/file_system.h"

namespace qtrain::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; qtrain maps it into tensors without byte swapping");

// The reference implementation refuses larger headers; so do we, before reading one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxDimensions = 64;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

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
    if (key_ == kMetadataKey) {
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
        key_ = kMetadataKey;  // so that an error after it does not name the last metadata key
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
      throw Error(where + " has dtype '" + info.dtype + "', which qtrain cannot read (it reads " +
                  safetensors_dtype_names() + ")");
    }
    uint64_t bytes = static_cast<uint64_t>(dtype->element_size());
    for (const int64_t dim : info.shape) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) {
        throw Error(where + " has shape " + shape_string(info.shape) + ", larger than any file: the header is damaged");
      }
    }
    if (info.end < info.begin) {
      throw Error(where + " data_offsets " + offsets_string(info) + " end before they begin: the header is damaged");
    }
    if (info.end - info.begin != bytes) {
      throw Error(where + " has shape " + shape_string(info.shape) + " of " + info.dtype + ", " +
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
      throw Error(where + " overlap those of tensor '" + previous->name + "' " + offsets_string(*previous) +
                  ": the header is damaged");
    }
    if (info.begin > expected_begin) {
      throw Error(where + " leave bytes [" + std::to_string(expected_begin) + ", " + std::to_string(info.begin) +
                  ") of the data section to no tensor, but safetensors packs tensors back to back: the header is "
                  "damaged");
    }
    if (info.end > data_bytes) {
      throw Error(where + " end past the file's data section (" + std::to_string(data_bytes) +
                  " bytes): the file is truncated or damaged");
    }
    expected_begin = info.end;
    previous = &info;
  }
  if (expected_begin != data_bytes) {
    throw Error(path + ": the data section has " + std::to_string(data_bytes) + " bytes but its tensors end at byte " +
                std::to_string(expected_begin) + ": the file has trailing bytes or a damaged header");
  }
}

// The largest nesting of JSON arrays and objects in `text`, counting no further than `limit + 1`.
// Lets a DOM parse refuse "[[[[..." before it allocates a node per bracket.
int json_depth(const std::string& text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size() && deepest <= limit; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

std::string errno_text() { return std::strerror(errno); }

// Closes a file descriptor when the scope ends.
struct DescriptorCloser {
  int descriptor;
  ~DescriptorCloser() { ::close(descriptor); }
};

std::string read_small_file(const std::string& path) {
  std::error_code error;
  const auto size = fs::file_size(path, error);
  if (error) throw Error(path + ": cannot read: " + error.message());
  if (size > kMaxHeaderBytes) {
    throw Error(path + ": " + std::to_string(size) +
                " bytes is too large for an index (at most 100 MB): the file is damaged");
  }
  std::ifstream stream(path, std::ios::binary);
  std::ostringstream text;
  text << stream.rdbuf();
  if (!stream) throw Error(path + ": cannot read: " + errno_text());
  return text.str();
}

bool is_weight_file_of_an_export(const std::string& file_name) {
  static const std::regex shard("model-[0-9]{5}-of-[0-9]{5}\\.safetensors");
  return file_name == kSingleFile || file_name == kIndexFile || std::regex_match(file_name, shard);
}

}  // namespace

struct SafetensorsFile::Mapping {
  void* address = nullptr;
  size_t length = 0;
  Mapping(void* address, size_t length) : address(address), length(length) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(address, length); }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int descriptor = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (descriptor < 0) throw Error(path + ": cannot open: " + errno_text());
  DescriptorCloser closer{descriptor};
  struct stat status {};
  if (::fstat(descriptor, &status) != 0) throw Error(path + ": cannot read: " + errno_text());
  if (!S_ISREG(status.st_mode)) throw Error(path + ": not a regular file; expected a .safetensors file");
  const auto file_bytes = static_cast<uint64_t>(status.st_size);
  if (file_bytes < 8) {
    throw Error(path + ": " + std::to_string(file_bytes) +
                " bytes, too short for a safetensors header: the file is truncated or not a safetensors file");
  }
  // Private and writable: tensors viewing the mapping may be changed in place (copy-on-write),
  // the file never.
  void* address = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, descriptor, 0);
  if (address == MAP_FAILED) throw Error(path + ": cannot memory-map: " + errno_text());

  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ = std::make_shared<const Mapping>(address, file_bytes);
  const auto* bytes = static_cast<const unsigned char*>(address);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    throw Error(path + ": header length " + std::to_string(header_bytes) +
                " bytes is over the 100 MB safetensors allows: the file is damaged or not a safetensors file");
  }
  if (header_bytes > file_bytes - 8) {
    throw Error(path + ": header length " + std::to_string(header_bytes) + " bytes runs past the end of the file (" +
                std::to_string(file_bytes) + " bytes): the file is truncated or not a safetensors file");
  }

  const auto* header_begin = reinterpret_cast<const char*>(bytes + 8);
  HeaderReader reader;
  bool parsed = false;
  try {
    parsed = json::sax_parse(header_begin, header_begin + header_bytes, &reader);
  } catch (const json::exception& exception) {
    reader.error = std::string("the header is not valid JSON (") + exception.what() + ")";
  }
  if (!parsed) {
    throw Error(path + ": " + (reader.error.empty() ? "the header is not a safetensors header" : reader.error) +
                ": the file is damaged or not a safetensors file");
  }
  file.data_ = bytes + 8 + header_bytes;
  check_tensors(path, reader.tensors, file_bytes - 8 - header_bytes);
  file.tensors_ = std::move(reader.tensors);
  file.metadata_ = std::move(reader.metadata);
  for (size_t i = 0; i < file.tensors_.size(); ++i) file.index_[file.tensors_[i].name] = i;
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& info : tensors_) names.push_back(info.name);
  return names;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto found = index_.find(name);
  if (found == index_.end()) {
    throw Error(path_ + ": no tensor named '" + name + "' (the file holds " + std::to_string(tensors_.size()) +
                " tensors)");
  }
  return tensors_[found->second];
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const auto& info = this->info(name);
  const auto dtype = *safetensors_dtype(info.dtype);  // checked when the file was opened
  const auto options = torch::TensorOptions().dtype(dtype.scalar_type);
  const unsigned char* bytes = data_ + info.begin;
  if (info.end == info.begin) return torch::empty(info.shape, options);
  if (reinterpret_cast<uintptr_t>(bytes) % static_cast<uintptr_t>(dtype.element_size()) != 0) {
    auto copy = torch::empty(info.shape, options);
    std::memcpy(copy.data_ptr(), bytes, info.end - info.begin);
    return copy;
  }
  // The deleter owns a share of the mapping: the view outlives this object safely.
  return torch::from_blob(
      const_cast<unsigned char*>(bytes), info.shape, [mapping = mapping_](void*) {}, options);
}

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& dir_or_file) {
  const fs::path given(dir_or_file);
  std::error_code error;
  if (!fs::exists(given, error)) {
    throw Error(dir_or_file +
                ": no such file or directory; expected a Hugging Face model directory or a "
                ".safetensors file");
  }
  SafetensorsCheckpoint checkpoint;
  fs::path index_path;
  std::vector<fs::path> shard_paths;
  std::vector<std::string> shard_names;  // as the index names them, beside shard_paths
  if (fs::is_directory(given, error)) {
    if (fs::exists(given / kIndexFile, error)) {
      index_path = given / kIndexFile;
    } else if (fs::exists(given / kSingleFile, error)) {
      shard_paths.push_back(given / kSingleFile);
    } else {
      for (const auto& entry : fs::directory_iterator(given, error)) {
        if (entry.path().extension() == ".safetensors") shard_paths.push_back(entry.path());
      }
      if (shard_paths.size() != 1) {
        throw Error(dir_or_file + ": found neither " + kSingleFile + " nor " + kIndexFile + " (and " +
                    std::to_string(shard_paths.size()) +
                    " other .safetensors files, not one): point at a Hugging Face model directory or at the "
                    "weights file itself");
      }
    }
  } else if (given.filename().string().size() > 5 &&
             given.filename().string().compare(given.filename().string().size() - 5, 5, ".json") == 0) {
    index_path = given;
  } else {
    shard_paths.push_back(given);
  }

  // name -> shard file, from the index when there is one.
  std::map<std::string, std::string> weight_map;
  if (!index_path.empty()) {
    const std::string index_name = index_path.string();
    checkpoint.source_ = index_name;
    const std::string text = read_small_file(index_name);
    if (json_depth(text, 3) > 3)
      throw Error(index_name + ": nested deeper than an index's {\"weight_map\": {...}}: the file is damaged");
    const json index = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      throw Error(index_name +
                  ": not a safetensors index (expected a JSON object with \"weight_map\": {tensor: "
                  "shard file}): the file is damaged");
    }
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (!shard.is_string()) throw Error(index_name + ": weight_map entry of '" + name + "' is not a file name");
      const auto relative = fs::path(shard.get<std::string>()).lexically_normal();
      const bool escapes = relative.empty() || relative.is_absolute() || *relative.begin() == "..";
      if (escapes) {
        throw Error(index_name + ": weight_map puts tensor '" + name + "' in '" + shard.get<std::string>() +
                    "', outside the model directory: shard files must be named relative to it, inside it");
      }
      weight_map[name] = relative.string();
      shard_names.push_back(relative.string());
    }
    // Shards in name order, model-00001-of-... first.
    std::sort(shard_names.begin(), shard_names.end());
    shard_names.erase(std::unique(shard_names.begin(), shard_names.end()), shard_names.end());
    for (const auto& shard : shard_names) shard_paths.push_back(index_path.parent_path() / shard);
  } else {
    checkpoint.source_ = shard_paths.front().string();
  }

  for (size_t i = 0; i < shard_paths.size(); ++i) {
    checkpoint.files_.push_back(SafetensorsFile::open(shard_paths[i].string()));
    for (const auto& name : checkpoint.files_.back().names()) {
      // A tensor a shard holds but the index does not list is not part of the checkpoint.
      if (!index_path.empty()) {
        const auto mapped = weight_map.find(name);
        if (mapped == weight_map.end() || mapped->second != shard_names[i]) continue;
      }
      checkpoint.file_of_[name] = checkpoint.files_.size() - 1;
      checkpoint.names_.push_back(name);
    }
  }
  for (const auto& [name, shard] : weight_map) {
    if (!checkpoint.file_of_.count(name)) {
      throw Error(checkpoint.source_ + ": weight_map puts tensor '" + name + "' in " + shard +
                  ", which does not hold it: the index and its shards disagree (download the checkpoint again)");
    }
  }
  return checkpoint;
}

size_t SafetensorsCheckpoint::file_index(const std::string& name) const {
  const auto found = file_of_.find(name);
  if (found == file_of_.end()) throw Error(source_ + ": no tensor named '" + name + "'");
  return found->second;
}

const TensorInfo& SafetensorsCheckpoint::info(const std::string& name) const {
  return files_[file_index(name)].info(name);
}

torch::Tensor SafetensorsCheckpoint::tensor(const std::string& name) const {
  return files_[file_index(name)].tensor(name);
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::vector<uint64_t> byte_counts;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::string where = path + ": tensor '" + name + "'";
    if (name == kMetadataKey) throw Error(where + ": safetensors reserves that name for the file's metadata");
    if (header.contains(name)) throw Error(where + " is given twice: tensor names must be unique");
    if (!tensor.defined()) throw Error(where + " is an undefined tensor");
    if (tensor.layout() != torch::kStrided) {
      throw Error(where + " is not dense; safetensors stores dense tensors (call to_dense() first)");
    }
    const auto dtype = safetensors_dtype(tensor.scalar_type());
    if (!dtype) {
      throw Error(where + " has dtype " + std::string(c10::toString(tensor.scalar_type())) +
                  ", which safetensors cannot store (convert it to one of " + safetensors_dtype_names() + ")");
    }
    const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * static_cast<uint64_t>(dtype->element_size());
    header[name] = json{{"dtype", dtype->name},
                        {"shape", tensor.sizes().vec()},
                        {"data_offsets", json::array({offset, offset + bytes})}};
    byte_counts.push_back(bytes);
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {
    throw Error(path + ": tensor names and metadata must be valid UTF-8");
  }
  // The data section starts 8-byte aligned, so every tensor the writer aligns stays aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  AtomicFile file(path);
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  file.write(length, sizeof length);
  file.write(text.data(), text.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (byte_counts[i] == 0) continue;
    // One tensor at a time on the CPU: writing a GPU model never holds a second copy of it.
    const auto cpu = tensors[i].second.detach().to(torch::kCPU).resolve_conj().resolve_neg().contiguous();
    file.write(cpu.data_ptr(), byte_counts[i]);
  }
  file.commit();
}

void write_safetensors_checkpoint(const std::string& dir,
                                  const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                  uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  // Shards filled greedily in order, as transformers' save_pretrained does.
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& named : tensors) {
    const uint64_t bytes = named.second.defined() ? named.second.numel() * named.second.element_size() : 0;
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(named);
    shard_bytes += bytes;
    total_bytes += bytes;
  }

  std::error_code error;
  fs::create_directories(dir, error);
  if (error) throw Error(dir + ": cannot create the directory: " + error.message());
  std::set<std::string> written;
  if (shards.size() == 1) {
    write_safetensors((fs::path(dir) / kSingleFile).string(), tensors, metadata);
    written.insert(kSingleFile);
  } else {
    json weight_map = json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      char file_name[64];
      std::snprintf(file_name, sizeof file_name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      write_safetensors((fs::path(dir) / file_name).string(), shards[i], metadata);
      for (const auto& named : shards[i]) weight_map[named.first] = file_name;
      written.insert(file_name);
    }
    const json index{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    AtomicFile file((fs::path(dir) / kIndexFile).string());
    file.write(text.data(), text.size());
    file.commit();
    written.insert(kIndexFile);
  }
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string file_name = entry.path().filename().string();
    if (is_weight_file_of_an_export(file_name) && !written.count(file_name)) fs::remove(entry.path(), error);
  }
}

}  // namespace qtrain::trainer
