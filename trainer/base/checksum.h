#pragma once
// CRC-32C (Castagnoli, the checksum of iSCSI, ext4 and Google's storage), for the manifests
// that let a reader tell a complete checkpoint from a damaged one.
#include <cstdint>
#include <string>

namespace qtrain::trainer {

uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
// The CRC-32C of a whole file as 8 lowercase hex digits; Error naming the file if unreadable.
std::string file_crc32c(const std::string& path);

}  // namespace qtrain::trainer
