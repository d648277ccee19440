#include "trainer/base/checksum.h"

#include <array>
#include <cstdio>
#include <fstream>
#include <vector>

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

// The reflected polynomial 0x82F63B78, one table entry per byte value.
std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t value = byte;
    for (int bit = 0; bit < 8; ++bit) value = (value >> 1) ^ (0x82F63B78u & (0u - (value & 1u)));
    table[byte] = value;
  }
  return table;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_table();
  const auto* bytes = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t index = 0; index < size; ++index) crc = table[(crc ^ bytes[index]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

std::string file_crc32c(const std::string& path) {
  std::ifstream input(path, std::ios::binary);
  if (!input) throw Error(ErrorCode::kCheckpoint, path + ": cannot open to check its checksum");
  std::vector<char> buffer(1 << 20);
  uint32_t crc = 0;
  while (input) {
    input.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    crc = crc32c(buffer.data(), static_cast<size_t>(input.gcount()), crc);
  }
  if (input.bad()) throw Error(ErrorCode::kCheckpoint, path + ": read error while checking its checksum");
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

}  // namespace qtrain::trainer
