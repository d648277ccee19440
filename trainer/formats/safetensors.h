#pragma once
// The safetensors format, read and written at the edge (huggingface/safetensors is the reference):
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  JSON header {"<name>": {"dtype": "BF16", "shape": [8192, 256],
//                                      "data_offsets": [begin, end]}, ...,
//                           "__metadata__": {"<key>": "<string>", ...}}   (optional)
//              padded with spaces so that 8 + N is a multiple of 8
//   [rest]     the data section: every tensor's bytes, row-major, little-endian, packed back to
//              back; data_offsets count from its first byte and cover it exactly
//
// A file is memory-mapped and its header checked completely when opened, so a truncated, lying
// or garbage file is an Error naming the file (and tensor) there, never a crash later.
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "trainer/formats/safetensors_header.h"

namespace qtrain::trainer {

// One .safetensors file, memory-mapped copy-on-write: tensors are zero-copy views into the
// mapping (which they keep alive), writable without changing the file.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in file order (by data offset)
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // Error naming the file and tensor if absent
  // A CPU tensor that stays valid after this object is gone. A view into the mapping when the
  // tensor's offset suits its dtype's alignment, else a copy.
  torch::Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }  // "__metadata__"

 private:
  struct Mapping;
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  const unsigned char* data_ = nullptr;            // the data section's first byte, inside the mapping
  std::vector<TensorInfo> tensors_;                // by data offset
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face model's weights: DIR/model.safetensors, the shards of
// DIR/model.safetensors.index.json ({"weight_map": {name: shard file}}), a directory holding
// exactly one other *.safetensors file (a PEFT adapter's), or the path of one such file or index.
class SafetensorsCheckpoint {
 public:
  static SafetensorsCheckpoint open(const std::string& dir_or_file);

  const std::string& source() const { return source_; }      // the file or index it was read from
  std::vector<std::string> names() const { return names_; }  // shard by shard, each in file order
  bool contains(const std::string& name) const { return file_of_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // Error naming the source and tensor if absent
  torch::Tensor tensor(const std::string& name) const;
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  size_t file_index(const std::string& name) const;

  std::string source_;
  std::vector<SafetensorsFile> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, size_t> file_of_;  // name -> position in files_
};

// Writes `tensors` (any device, any layout in memory) in the given order, contiguous and
// little-endian, with `metadata` as "__metadata__" when it is not empty. Written to PATH.tmp,
// fsynced, then renamed over PATH, so PATH is either the old file or the complete new one.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes a model's weights into `dir` as save_pretrained does: DIR/model.safetensors, or, when
// they exceed `max_shard_bytes`, DIR/model-00001-of-0000N.safetensors ... plus
// DIR/model.safetensors.index.json. Shards are filled in the given order and each holds
// `metadata`. Weight files of an earlier export in `dir` that this one does not write are
// removed, so SafetensorsCheckpoint::open(dir) reads exactly these tensors.
void write_safetensors_checkpoint(const std::string& dir,
                                  const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                  uint64_t max_shard_bytes = 5'000'000'000,
                                  const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace qtrain::trainer
