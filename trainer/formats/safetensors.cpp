#include "trainer/formats/safetensors.h"

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

#include "kernels/error.h"
#include "trainer/base/dtype_names.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/safetensors_header.h"

namespace qtrain::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; qtrain maps it into tensors without byte swapping");

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

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
  if (error) throw Error(ErrorCode::kFileSystem, path + ": cannot read: " + error.message());
  if (size > kSafetensorsMaxHeaderBytes) {
    throw Error(ErrorCode::kWeights, path + ": " + std::to_string(size) +
                " bytes is too large for an index (at most 100 MB): the file is damaged");
  }
  std::ifstream stream(path, std::ios::binary);
  std::ostringstream text;
  text << stream.rdbuf();
  if (!stream) throw Error(ErrorCode::kFileSystem, path + ": cannot read: " + errno_text());
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
  if (descriptor < 0) throw Error(ErrorCode::kFileSystem, path + ": cannot open: " + errno_text());
  DescriptorCloser closer{descriptor};
  struct stat status {};
  if (::fstat(descriptor, &status) != 0) throw Error(ErrorCode::kFileSystem, path + ": cannot read: " + errno_text());
  if (!S_ISREG(status.st_mode)) throw Error(ErrorCode::kWeights, path + ": not a regular file; expected a .safetensors file");
  const auto file_bytes = static_cast<uint64_t>(status.st_size);
  SafetensorsFile file;
  file.path_ = path;
  const unsigned char* bytes = nullptr;
  if (file_bytes >= 8) {  // else read_safetensors_header says the file is too short
    // Private and writable: tensors viewing the mapping may be changed in place (copy-on-write),
    // the file never.
    void* address = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, descriptor, 0);
    if (address == MAP_FAILED) throw Error(ErrorCode::kFileSystem, path + ": cannot memory-map: " + errno_text());
    file.mapping_ = std::make_shared<const Mapping>(address, file_bytes);
    bytes = static_cast<const unsigned char*>(address);
  }
  SafetensorsHeader header = read_safetensors_header(path, bytes, file_bytes);
  file.data_ = bytes + 8 + header.header_bytes;
  file.tensors_ = std::move(header.tensors);
  file.metadata_ = std::move(header.metadata);
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
    throw Error(ErrorCode::kWeights, path_ + ": no tensor named '" + name + "' (the file holds " + std::to_string(tensors_.size()) +
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
    throw Error(ErrorCode::kWeights, dir_or_file +
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
        throw Error(ErrorCode::kWeights, dir_or_file + ": found neither " + kSingleFile + " nor " + kIndexFile + " (and " +
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
      throw Error(ErrorCode::kWeights, index_name + ": nested deeper than an index's {\"weight_map\": {...}}: the file is damaged");
    const json index = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      throw Error(ErrorCode::kWeights, index_name +
                  ": not a safetensors index (expected a JSON object with \"weight_map\": {tensor: "
                  "shard file}): the file is damaged");
    }
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (!shard.is_string()) throw Error(ErrorCode::kWeights, index_name + ": weight_map entry of '" + name + "' is not a file name");
      const auto relative = fs::path(shard.get<std::string>()).lexically_normal();
      const bool escapes = relative.empty() || relative.is_absolute() || *relative.begin() == "..";
      if (escapes) {
        throw Error(ErrorCode::kWeights, index_name + ": weight_map puts tensor '" + name + "' in '" + shard.get<std::string>() +
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
      throw Error(ErrorCode::kWeights, checkpoint.source_ + ": weight_map puts tensor '" + name + "' in " + shard +
                  ", which does not hold it: the index and its shards disagree (download the checkpoint again)");
    }
  }
  return checkpoint;
}

size_t SafetensorsCheckpoint::file_index(const std::string& name) const {
  const auto found = file_of_.find(name);
  if (found == file_of_.end()) throw Error(ErrorCode::kWeights, source_ + ": no tensor named '" + name + "'");
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
  if (!metadata.empty()) header[kSafetensorsMetadataKey] = metadata;
  std::vector<uint64_t> byte_counts;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::string where = path + ": tensor '" + name + "'";
    if (name == kSafetensorsMetadataKey) throw Error(ErrorCode::kWeights, where + ": safetensors reserves that name for the file's metadata");
    if (header.contains(name)) throw Error(ErrorCode::kWeights, where + " is given twice: tensor names must be unique");
    if (!tensor.defined()) throw Error(ErrorCode::kWeights, where + " is an undefined tensor");
    if (tensor.layout() != torch::kStrided) {
      throw Error(ErrorCode::kWeights, where + " is not dense; safetensors stores dense tensors (call to_dense() first)");
    }
    const auto dtype = safetensors_dtype(tensor.scalar_type());
    if (!dtype) {
      throw Error(ErrorCode::kWeights, where + " has dtype " + std::string(c10::toString(tensor.scalar_type())) +
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
    throw Error(ErrorCode::kWeights, path + ": tensor names and metadata must be valid UTF-8");
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
  if (error) throw Error(ErrorCode::kFileSystem, dir + ": cannot create the directory: " + error.message());
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
