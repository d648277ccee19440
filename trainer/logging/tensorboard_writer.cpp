#include "trainer/logging/tensorboard_writer.h"

#include <unistd.h>

#include <filesystem>

#include "kernels/error.h"
#include "trainer/base/checksum.h"
#include "trainer/logging/tensorboard_event.h"

namespace qtrain::trainer {

namespace {

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

void put_little_endian(std::string& out, uint64_t value, int bytes) {
  for (int index = 0; index < bytes; ++index) out.push_back(static_cast<char>((value >> (8 * index)) & 0xff));
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& directory, double wall_time) {
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  path_ = directory + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(wall_time)) + "." + host_name() +
          "." + std::to_string(getpid()) + ".qtrain";
  file_.open(path_, std::ios::binary | std::ios::trunc);
  if (!file_) throw Error(ErrorCode::kFileSystem, path_ + ": cannot create the TensorBoard event file (log.tensorboard: false turns it off)");
  write(file_version_event(wall_time));
  flush();
}

void TensorBoardWriter::scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  write(scalar_event(tag, value, step, wall_time));
}

void TensorBoardWriter::text(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  write(text_event(tag, text, step, wall_time));
}

void TensorBoardWriter::write(const std::string& data) {
  std::string record;
  put_little_endian(record, data.size(), 8);
  put_little_endian(record, masked_crc32c(record.data(), 8), 4);
  record += data;
  put_little_endian(record, masked_crc32c(data.data(), data.size()), 4);
  file_.write(record.data(), static_cast<std::streamsize>(record.size()));
  if (!file_) throw Error(ErrorCode::kFileSystem, path_ + ": cannot write (is the disk full?)");
}

void TensorBoardWriter::flush() {
  file_.flush();
  if (!file_) throw Error(ErrorCode::kFileSystem, path_ + ": cannot write (is the disk full?)");
}

}  // namespace qtrain::trainer
