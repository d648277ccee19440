// llm.c .bin token files: the header layout llm.c writes, both token widths, and clear errors
// for damaged files.
#include "data/token_file.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kernels/error.h"
#include "support.h"

namespace qtrain::data {
namespace {

using qtrain::testing::TempDir;

int32_t header_int(const std::string& bytes, int index) {
  int32_t value = 0;
  std::memcpy(&value, bytes.data() + 4 * index, 4);  // little-endian host, as llm.c assumes
  return value;
}

std::string expect_error(const std::string& path, int64_t vocab_size) {
  try {
    read_token_file(path, vocab_size);
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "expected an error reading " << path;
  return "";
}

TEST(TokenFile, SmallVocabulariesUseLlmcsUint16Layout) {
  const std::vector<int64_t> tokens = {0, 1, 65535, 300, 7};
  const std::string bytes = encode_token_file(tokens, 65536);
  ASSERT_EQ(bytes.size(), 1024u + 2 * tokens.size());
  EXPECT_EQ(header_int(bytes, 0), 20240520);
  EXPECT_EQ(header_int(bytes, 1), 1);
  EXPECT_EQ(header_int(bytes, 2), 5);
  for (int index = 3; index < 256; ++index) EXPECT_EQ(header_int(bytes, index), 0);
  EXPECT_EQ(static_cast<unsigned char>(bytes[1024 + 4]), 0xffu);  // 65535, low byte first
  TempDir dir;
  const auto path = dir.write("t.bin", bytes);
  EXPECT_EQ(read_token_file(path, 65536), tokens);
}

TEST(TokenFile, LargeVocabulariesUseLlmcsUint32Layout) {
  const std::vector<int64_t> tokens = {128000, 9906, 128255, 0};
  const std::string bytes = encode_token_file(tokens, 128256);
  ASSERT_EQ(bytes.size(), 1024u + 4 * tokens.size());
  EXPECT_EQ(header_int(bytes, 0), 20240801);
  EXPECT_EQ(header_int(bytes, 1), 7);
  TempDir dir;
  EXPECT_EQ(read_token_file(dir.write("t.bin", bytes), 128256), tokens);
}

TEST(TokenFile, DamagedFilesAreClearErrors) {
  TempDir dir;
  const std::string good = encode_token_file({1, 2, 3, 4}, 1000);
  std::string wrong_magic = good;
  wrong_magic[0] = 1;
  EXPECT_NE(expect_error(dir.write("magic.bin", wrong_magic), 1000).find("magic"), std::string::npos);
  std::string wrong_version = good;
  wrong_version[4] = 3;
  EXPECT_NE(expect_error(dir.write("version.bin", wrong_version), 1000).find("version"), std::string::npos);
  EXPECT_NE(expect_error(dir.write("short.bin", good.substr(0, good.size() - 1)), 1000).find("truncated"),
            std::string::npos);
  EXPECT_NE(expect_error(dir.write("header.bin", good.substr(0, 100)), 1000).find("header"), std::string::npos);
  EXPECT_NE(expect_error(dir.write("vocab.bin", good), 3).find("vocabulary"), std::string::npos);
  std::string huge_count = good;
  huge_count[11] = 0x7f;  // claims ~2 billion tokens: refused before anything is allocated
  EXPECT_NE(expect_error(dir.write("count.bin", huge_count), 1000).find("truncated"), std::string::npos);
  expect_error(dir.file("missing.bin"), 1000);
}

TEST(TokenFile, DocumentsStartAtEachBos) {
  EXPECT_EQ(split_documents({9, 5, 6, 9, 7, 9, 9, 8}, 9),
            (std::vector<std::vector<int64_t>>{{9, 5, 6}, {9, 7}, {9}, {9, 8}}));
  EXPECT_EQ(split_documents({4, 5, 9, 6}, 9), (std::vector<std::vector<int64_t>>{{4, 5}, {9, 6}}));
  EXPECT_EQ(split_documents({4, 5}, -1), (std::vector<std::vector<int64_t>>{{4, 5}}));
}

}  // namespace
}  // namespace qtrain::data
