// The GGUF v3 container: what the writer writes, the reader reads back; bytes laid out as the
// format document says; and bad input to the reader is an Error, never a crash.
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/error.h"
#include "support.h"
#include "trainer/formats/gguf_file.h"

namespace qtrain::trainer {
namespace {

using testing::TempDir;

std::vector<uint8_t> float_bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// A small file: every scalar type, arrays, and two tensors (one of them 2-D).
std::string write_sample(const TempDir& temp) {
  const std::string path = temp.file("sample.gguf");
  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"general.architecture", std::string("llama")},
      {"u8", uint8_t{200}}, {"i8", int8_t{-3}}, {"u16", uint16_t{60000}}, {"i16", int16_t{-30000}},
      {"u32", uint32_t{4000000000u}}, {"i32", int32_t{-7}}, {"f32", 0.5f}, {"flag", true},
      {"u64", uint64_t{1} << 40}, {"i64", int64_t{-1} << 40}, {"f64", 0.25},
      {"names", GgufValue::strings({"a", "", "ümlaut"})},
      {"ids", GgufValue::int32s({1, -2, 3})},
      {"scales", GgufValue::float32s({1.5f, -2.0f})},
  };
  std::vector<GgufTensorSource> tensors = {
      {"vector", {3}, qat::GgufBlockType::kF32, [] { return float_bytes({1, 2, 3}); }},
      {"matrix", {2, 5}, qat::GgufBlockType::kF32, [] { return float_bytes({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}); }},
  };
  write_gguf(path, metadata, tensors);
  return path;
}

TEST(GgufFile, ReadsBackWhatItWrote) {
  TempDir temp;
  const auto file = GgufFile::open(write_sample(temp));
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 32u);
  EXPECT_EQ(file.value("general.architecture").as<std::string>("arch"), "llama");
  EXPECT_EQ(file.value("u8").as<uint8_t>("u8"), 200);
  EXPECT_EQ(file.value("i8").as<int8_t>("i8"), -3);
  EXPECT_EQ(file.value("u16").as<uint16_t>("u16"), 60000);
  EXPECT_EQ(file.value("i16").as<int16_t>("i16"), -30000);
  EXPECT_EQ(file.value("u32").as<uint32_t>("u32"), 4000000000u);
  EXPECT_EQ(file.value("i32").as<int32_t>("i32"), -7);
  EXPECT_EQ(file.value("f32").as<float>("f32"), 0.5f);
  EXPECT_TRUE(file.value("flag").as<bool>("flag"));
  EXPECT_EQ(file.value("u64").as<uint64_t>("u64"), uint64_t{1} << 40);
  EXPECT_EQ(file.value("i64").as<int64_t>("i64"), int64_t{-1} << 40);
  EXPECT_EQ(file.value("f64").as<double>("f64"), 0.25);
  EXPECT_EQ(file.value("names").array_as<std::string>("names"), (std::vector<std::string>{"a", "", "ümlaut"}));
  EXPECT_EQ(file.value("ids").array_as<int32_t>("ids"), (std::vector<int32_t>{1, -2, 3}));
  EXPECT_EQ(file.value("scales").array_as<float>("scales"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_THROW(file.value("ids").as<int32_t>("ids"), Error);
  EXPECT_THROW(file.value("missing"), Error);

  const auto& matrix = file.tensor("matrix");
  EXPECT_EQ(matrix.shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(matrix.type, qat::GgufBlockType::kF32);
  EXPECT_EQ(matrix.offset % 32, 0u);
  EXPECT_EQ(file.tensor_bytes("matrix"), float_bytes({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(file.tensor_bytes("vector"), float_bytes({1, 2, 3}));
}

TEST(GgufFile, LaysOutHeaderAsTheFormatSays) {
  TempDir temp;
  const auto bytes = testing::read_text(write_sample(temp));
  ASSERT_GE(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(0, 4), "GGUF");
  uint32_t version = 0;
  uint64_t tensor_count = 0, kv_count = 0;
  std::memcpy(&version, bytes.data() + 4, 4);
  std::memcpy(&tensor_count, bytes.data() + 8, 8);
  std::memcpy(&kv_count, bytes.data() + 16, 8);
  EXPECT_EQ(version, 3u);
  EXPECT_EQ(tensor_count, 2u);
  EXPECT_EQ(kv_count, 15u);
  // The first key: u64 length 20, "general.architecture", type 8 (string), u64 5, "llama".
  uint64_t key_length = 0;
  std::memcpy(&key_length, bytes.data() + 24, 8);
  EXPECT_EQ(key_length, 20u);
  EXPECT_EQ(bytes.substr(32, 20), "general.architecture");
  uint32_t type = 0;
  std::memcpy(&type, bytes.data() + 52, 4);
  EXPECT_EQ(type, 8u);
  // The 2-D tensor records ne = [5, 2] (ggml order): find its info after its name.
  const auto at = bytes.find("matrix");
  ASSERT_NE(at, std::string::npos);
  uint32_t dims = 0;
  uint64_t ne[2] = {0, 0};
  std::memcpy(&dims, bytes.data() + at + 6, 4);
  std::memcpy(ne, bytes.data() + at + 10, 16);
  EXPECT_EQ(dims, 2u);
  EXPECT_EQ(ne[0], 5u);
  EXPECT_EQ(ne[1], 2u);
  EXPECT_EQ(bytes.size() % 32, 0u);
}

TEST(GgufFile, EveryTruncationIsAnError) {
  TempDir temp;
  const auto text = testing::read_text(write_sample(temp));
  const std::vector<uint8_t> whole(text.begin(), text.end());
  EXPECT_NO_THROW(GgufFile::parse(whole, "whole"));
  for (size_t length = 0; length < whole.size(); ++length) {
    std::vector<uint8_t> cut(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(length));
    // The last tensor's padding is not data: cutting only padding still leaves a valid file.
    try {
      const auto file = GgufFile::parse(cut, "cut");
      EXPECT_GE(length, whole.size() - 32) << "a file cut at " << length << " bytes parsed";
    } catch (const Error&) {
    }
  }
}

TEST(GgufFile, HugeCountsAndBadOffsetsAreErrorsNotAllocations) {
  TempDir temp;
  const auto text = testing::read_text(write_sample(temp));
  const std::vector<uint8_t> whole(text.begin(), text.end());
  auto patched = [&](size_t offset, uint64_t value, size_t width) {
    auto bytes = whole;
    std::memcpy(bytes.data() + offset, &value, width);
    return bytes;
  };
  auto expect_error = [](const std::vector<uint8_t>& bytes, const std::string& needle) {
    try {
      GgufFile::parse(bytes, "patched.gguf");
      ADD_FAILURE() << "parsed; expected an error mentioning '" << needle << "'";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
    }
  };
  expect_error(patched(0, 'X', 1), "not a GGUF file");
  expect_error(patched(4, 2, 4), "version 2");
  expect_error(patched(8, uint64_t{1} << 60, 8), "tensors cannot fit");
  expect_error(patched(16, uint64_t{1} << 60, 8), "metadata entries cannot fit");
  expect_error(patched(24, uint64_t{1} << 50, 8), "more than the file has left");  // first key's length
  // The string array "names": its element count.
  const auto names = text.find("names");
  expect_error(patched(names + 5 + 4 + 4, uint64_t{1} << 58, 8), "does not fit");
  // The matrix tensor: its type and its offset (after name, dims, 2 x ne, type).
  const auto matrix = text.find("matrix");
  expect_error(patched(matrix + 6 + 4 + 16, 99, 4), "ggml type 99");
  expect_error(patched(matrix + 6 + 4 + 16 + 4, 1u << 20, 8), "outside the data section");
  expect_error(patched(matrix + 6 + 4 + 16 + 4, 4, 8), "not a multiple of the alignment");
  expect_error(patched(matrix + 6, 7, 4), "dimensions");
}

TEST(GgufFile, WriterRefusesBytesThatDoNotMatchTheShape) {
  TempDir temp;
  std::vector<GgufTensorSource> tensors = {{"short", {4}, qat::GgufBlockType::kF32, [] { return float_bytes({1, 2}); }}};
  EXPECT_THROW(write_gguf(temp.file("bad.gguf"), {}, tensors), Error);
  std::vector<GgufTensorSource> odd = {{"q", {2, 20}, qat::GgufBlockType::kQ4_0, [] { return std::vector<uint8_t>(); }}};
  EXPECT_THROW(write_gguf(temp.file("bad.gguf"), {}, odd), Error);  // 20 is not whole blocks of 32
}

}  // namespace
}  // namespace qtrain::trainer
