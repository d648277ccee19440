#pragma once
// TensorBoard's event files, as the HF Trainer, Lightning and torchtune leave them:
// DIR/events.out.tfevents.<seconds>.<host>.<pid>.qtrain, a sequence of TFRecords (the Event's
// length as 8 little-endian bytes, its masked CRC-32C, the Event serialized by protobuf, its
// masked CRC-32C). The first Event names the file version; each later one holds one scalar or
// one text (the text plugin's DT_STRING tensor); trainer/logging/tensorboard_event.h makes them.
#include <cstdint>
#include <fstream>
#include <string>

namespace qtrain::trainer {

class TensorBoardWriter {
 public:
  // Creates `directory` and a new event file in it; Error naming the file when it cannot.
  explicit TensorBoardWriter(const std::string& directory, double wall_time);

  void scalar(const std::string& tag, double value, int64_t step, double wall_time);
  void text(const std::string& tag, const std::string& text, int64_t step, double wall_time);
  // Makes what was written readable now (TensorBoard reads a file while it grows).
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& event);  // one serialized Event (tensorboard_event.h)

  std::string path_;
  std::ofstream file_;
};

// TFRecord's checksum: the CRC-32C rotated right by 15 bits plus a constant, so that a CRC
// stored inside checksummed data does not checksum to a fixed value.
uint32_t masked_crc32c(const void* data, size_t size);

}  // namespace qtrain::trainer
