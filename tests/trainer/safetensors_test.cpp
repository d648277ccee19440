// safetensors read and write: the fixtures made by the Python stack, round trips of every dtype,
// the Python library reading what we write, and damaged files giving errors that name them.
#include "trainer/formats/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <tuple>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "support.h"
#include "trainer/base/dtype_names.h"

namespace qtrain::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::fixture;
using testing::TempDir;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

std::string read_bytes(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string length_prefix(uint64_t length) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(length >> (8 * i));
  return bytes;
}

// A safetensors file as the format lays it out, from a header text we choose.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

// The bytes a tensor holds, row-major: bit-exact comparisons for every dtype.
std::string tensor_bytes(const torch::Tensor& tensor) {
  const auto contiguous = tensor.contiguous();
  return std::string(static_cast<const char*>(contiguous.data_ptr()), contiguous.numel() * contiguous.element_size());
}

// The message of the qtrain::Error that opening `path` as a `File` (SafetensorsFile or
// SafetensorsCheckpoint) throws; fails the test when none is thrown.
template <typename File>
std::string open_error(const std::string& path) {
  const std::string message = testing::error_message([&] { File::open(path); });
  if (message.empty()) ADD_FAILURE() << "no Error opening " << path;
  return message;
}

// Random bytes of `shape` as `dtype`: every bit pattern, NaNs included (BOOL holds 0 and 1).
torch::Tensor random_tensor(c10::ScalarType dtype, std::vector<int64_t> shape) {
  const int64_t element_size = c10::elementSize(dtype);
  int64_t count = 1;
  for (auto dim : shape) count *= dim;
  if (dtype == torch::kBool) return torch::randint(0, 2, {count}, torch::kUInt8).to(torch::kBool).view(shape);
  return torch::randint(0, 256, {count * element_size}, torch::kUInt8).view(dtype).view(shape);
}

// Every dtype of the table, by its safetensors name.
std::vector<SafetensorsDtype> all_dtypes() {
  std::vector<SafetensorsDtype> dtypes;
  std::string names = safetensors_dtype_names() + ", ";
  for (size_t begin = 0, end; (end = names.find(", ", begin)) != std::string::npos; begin = end + 2) {
    dtypes.push_back(*safetensors_dtype(names.substr(begin, end - begin)));
  }
  return dtypes;
}

Named one_tensor_of_each_dtype() {
  Named tensors;
  for (const auto& dtype : all_dtypes())
    tensors.emplace_back(std::string("t.") + dtype.name, random_tensor(dtype.scalar_type, {3, 5}));
  return tensors;
}

void expect_same_tensors(const SafetensorsFile& file, const Named& expected) {
  ASSERT_EQ(file.names().size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    SCOPED_TRACE(name);
    const auto read = file.tensor(name);
    EXPECT_EQ(read.scalar_type(), tensor.scalar_type());
    EXPECT_EQ(read.sizes(), tensor.sizes());
    EXPECT_EQ(tensor_bytes(read), tensor_bytes(tensor));
  }
}

TEST(Safetensors, ReadsTheTinyLlamaFixture) {
  const auto file = SafetensorsFile::open(fixture("tiny-llama/model.safetensors"));
  // 4 layers x 9 tensors, embed_tokens, norm, lm_head (untied)
  EXPECT_EQ(file.names().size(), 39u);
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  const auto& embed = file.info("model.embed_tokens.weight");
  EXPECT_EQ(embed.dtype, "BF16");
  EXPECT_EQ(embed.shape, (std::vector<int64_t>{8192, 256}));
  EXPECT_EQ(embed.end - embed.begin, 8192u * 256u * 2u);
  EXPECT_EQ(file.info("model.layers.3.self_attn.k_proj.weight").shape, (std::vector<int64_t>{64, 256}));
  EXPECT_EQ(file.info("model.layers.0.mlp.down_proj.weight").shape, (std::vector<int64_t>{256, 768}));

  const auto weight = file.tensor("model.norm.weight");
  EXPECT_EQ(weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(weight.sizes(), torch::IntArrayRef({256}));
  EXPECT_TRUE(weight.isfinite().all().item<bool>());
  EXPECT_GT(weight.abs().sum().item<double>(), 0.0);

  uint64_t previous_begin = 0;
  for (const auto& name : file.names()) {
    EXPECT_GE(file.info(name).begin, previous_begin) << "names() is in file order";
    previous_begin = file.info(name).begin;
  }
}

TEST(Safetensors, ReadsTheBitsandbytesReferenceTypes) {
  const auto file = SafetensorsFile::open(fixture("bnb-4bit-reference.safetensors"));
  EXPECT_EQ(file.names().size(), 135u);
  const std::string prefix = "randn_256x512.nf4.b64.nodq.";
  const auto packed = file.tensor(prefix + "packed");
  EXPECT_EQ(packed.scalar_type(), torch::kUInt8);
  EXPECT_EQ(packed.sizes(), torch::IntArrayRef({256 * 512 / 2, 1}));
  EXPECT_EQ(packed[0][0].item<uint8_t>(), 121);  // as Python reads it

  const auto code = file.tensor(prefix + "code");  // the NF4 table: -1 .. 0 .. 1
  EXPECT_EQ(code.scalar_type(), torch::kFloat32);
  EXPECT_EQ(code[0].item<float>(), -1.0f);
  EXPECT_EQ(code[7].item<float>(), 0.0f);
  EXPECT_EQ(code[15].item<float>(), 1.0f);
  EXPECT_NEAR(code[1].item<float>(), -0.6962, 1e-4);

  const auto absmax = file.tensor(prefix + "absmax");
  EXPECT_EQ(absmax.scalar_type(), torch::kFloat32);
  EXPECT_EQ(absmax.numel(), 256 * 512 / 64);
  EXPECT_EQ(absmax[0].item<float>(), 2.4375f);

  const auto dequant = file.tensor(prefix + "dequant");
  EXPECT_EQ(dequant.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(dequant.sizes(), torch::IntArrayRef({256, 512}));
  EXPECT_NEAR(dequant[0][1].item<float>(), 0.3926, 1e-3);

  const auto absmax_q = file.tensor("randn_256x512.nf4.b64.dq.absmax_q");
  EXPECT_EQ(absmax_q.scalar_type(), torch::kUInt8);
}

TEST(Safetensors, RoundTripsEveryDtypeBitExactWithMetadata) {
  TempDir directory;
  auto tensors = one_tensor_of_each_dtype();
  tensors.emplace_back("scalar", torch::tensor(3.5, torch::kFloat64));
  tensors.emplace_back("empty", torch::empty({0, 4}, torch::kBFloat16));
  tensors.emplace_back("transposed", torch::arange(12, torch::kInt32).view({3, 4}).t());  // not contiguous
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"scheme", "int4 symmetric, group 32"}};
  const auto path = directory.file("all.safetensors");
  write_safetensors(path, tensors, metadata);

  const auto file = SafetensorsFile::open(path);
  expect_same_tensors(file, tensors);
  EXPECT_EQ(file.metadata(), metadata);
  EXPECT_EQ(file.names().front(), "t.F64") << "written in the given order";
  EXPECT_EQ(file.names().back(), "transposed");
  EXPECT_EQ(file.info("scalar").shape, std::vector<int64_t>{});
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(Safetensors, WriterPadsTheHeaderToEightBytes) {
  TempDir directory;
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    const auto path = directory.file(name + ".safetensors");
    write_safetensors(path, {{name, torch::ones({2}, torch::kFloat32)}});
    const auto bytes = read_bytes(path);
    uint64_t header_length = 0;
    std::memcpy(&header_length, bytes.data(), 8);
    EXPECT_EQ(header_length % 8, 0u) << name;
    EXPECT_EQ(bytes.size(), 8 + header_length + 8) << name;
    const auto header = bytes.substr(8, header_length);
    EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}')) << "padded with spaces: " << header;
  }
}

TEST(Safetensors, PythonSafetensorsReadsOurFilesAndWeReadItsFiles) {
  const auto lacks = testing::python_lacks("torch safetensors");
  if (!lacks.empty()) GTEST_SKIP() << lacks;
  TempDir directory;
  const auto tensors = one_tensor_of_each_dtype();
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"note", "from qtrain"}};
  write_safetensors(directory.file("ours.safetensors"), tensors, metadata);
  // Python loads our file and saves what it read (in its own layout, sorted by dtype alignment):
  // reading that back equal to what we wrote checks both directions.
  write_bytes(directory.file("resave.py"),
              "import sys\n"
              "from safetensors import safe_open\n"
              "from safetensors.torch import load_file, save_file\n"
              "with safe_open(sys.argv[1], 'pt') as f:\n"
              "    metadata = f.metadata()\n"
              "tensors = load_file(sys.argv[1])\n"
              "save_file(tensors, sys.argv[2], metadata=metadata)\n"
              "print(len(tensors), tensors['t.BF16'].dtype, list(tensors['t.BF16'].shape))\n");
  const auto result =
      testing::run_command(testing::python() + " " + directory.file("resave.py") + " " +
                           directory.file("ours.safetensors") + " " + directory.file("theirs.safetensors") + " 2>&1");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find(std::to_string(tensors.size()) + " torch.bfloat16 [3, 5]"), std::string::npos)
      << result.output;
  const auto theirs = SafetensorsFile::open(directory.file("theirs.safetensors"));
  expect_same_tensors(theirs, tensors);
  EXPECT_EQ(theirs.metadata(), metadata);
}

TEST(Safetensors, MisalignedTensorsAreCopiedCorrectly) {
  TempDir directory;
  const auto path = directory.file("misaligned.safetensors");
  const auto values = torch::tensor({1.5, -2.25, 3.0}, torch::kFloat64);
  write_safetensors(path, {{"byte", torch::ones({1}, torch::kUInt8)}, {"values", values}});  // "values" at offset 1
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.info("values").begin, 1u);
  EXPECT_TRUE(torch::equal(file.tensor("values"), values));
}

TEST(Safetensors, TensorsOutliveTheFileObject) {
  torch::Tensor embed;
  {
    const auto file = SafetensorsFile::open(fixture("tiny-llama/model.safetensors"));
    embed = file.tensor("model.embed_tokens.weight");
  }
  EXPECT_EQ(embed.sizes(), torch::IntArrayRef({8192, 256}));
  EXPECT_TRUE(embed.isfinite().all().item<bool>());
}

TEST(Safetensors, LoadedTensorsCanChangeInPlaceWithoutChangingTheFile) {
  TempDir directory;
  const auto path = directory.file("weights.safetensors");
  write_safetensors(path, {{"w", torch::ones({4, 4}, torch::kFloat32)}});
  const auto before = read_bytes(path);
  {
    auto weight = SafetensorsFile::open(path).tensor("w");
    weight.mul_(3.0f);
    EXPECT_EQ(weight.sum().item<float>(), 48.0f);
  }
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(SafetensorsFile::open(path).tensor("w").sum().item<float>(), 16.0f);
}

TEST(Safetensors, MissingTensorIsAnErrorNamingFileAndTensor) {
  const auto path = fixture("tiny-llama/model.safetensors");
  const auto file = SafetensorsFile::open(path);
  EXPECT_FALSE(file.contains("model.layers.9.mlp.up_proj.weight"));
  try {
    file.tensor("model.layers.9.mlp.up_proj.weight");
    FAIL() << "no Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("'model.layers.9.mlp.up_proj.weight'"), std::string::npos) << error.what();
  }
  EXPECT_THROW(SafetensorsCheckpoint::open(fixture("tiny-llama")).info("nope"), Error);
}

TEST(Safetensors, TruncatedFilesAreErrorsNamingTheFile) {
  TempDir directory;
  const auto bytes = read_bytes(fixture("tiny-llama/model.safetensors"));
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  for (const size_t size :
       {size_t{0}, size_t{3}, size_t{8}, size_t{100}, size_t(8 + header_length - 1), size_t(8 + header_length),
        size_t(8 + header_length + 1000), bytes.size() / 2, bytes.size() - 1}) {
    SCOPED_TRACE(size);
    const auto path = directory.file("truncated-" + std::to_string(size) + ".safetensors");
    write_bytes(path, bytes.substr(0, size));
    const auto message = open_error<SafetensorsFile>(path);
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  }
  // The brief's example: a tensor that ends past the data section names itself and its offsets.
  const auto message =
      open_error<SafetensorsFile>(directory.file("truncated-" + std::to_string(bytes.size() - 1) + ".safetensors"));
  EXPECT_NE(message.find("end past the file's data section"), std::string::npos) << message;
}

TEST(Safetensors, LyingHeaderLengthsAreErrors) {
  TempDir directory;
  const auto bytes = read_bytes(fixture("tiny-llama/model.safetensors"));
  const std::vector<std::pair<uint64_t, std::string>> cases{
      {~uint64_t{0}, "over the 100 MB"},
      {uint64_t{1} << 63, "over the 100 MB"},
      {100'000'001, "over the 100 MB"},
      {bytes.size(), "runs past the end of the file"},
      {bytes.size() - 8 + 1, "runs past the end of the file"},
      {0, "not valid JSON"},
      {7, "not valid JSON"},
  };
  for (const auto& [length, expected] : cases) {
    SCOPED_TRACE(length);
    const auto path = directory.file("length-" + std::to_string(length) + ".safetensors");
    write_bytes(path, length_prefix(length) + bytes.substr(8));
    const auto message = open_error<SafetensorsFile>(path);
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
}

TEST(Safetensors, MalformedHeadersAreErrors) {
  TempDir directory;
  const std::string four_bytes(4, '\0');
  const std::string deep = std::string(10'000'000, '[') + std::string(10'000'000, ']');
  std::string sixty_four_more_dims;
  for (int i = 0; i < 64; ++i) sixty_four_more_dims += ", 1";
  const std::vector<std::pair<std::string, std::string>> cases{
      {"not json at all", "not valid JSON"},
      {"{\"a\": {\"dtype\": \"F32\"", "not valid JSON"},
      {"[1, 2, 3]", "not a JSON object"},
      {"\"text\"", "not a JSON object"},
      {"null", "not a JSON object"},
      {"{} trailing", "not valid JSON"},
      {"{\"a\": 1}", "entry 'a' is a number, not an object"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", "lacks one of"},
      {"{\"a\": {\"dtype\": 32, \"shape\": [1], \"data_offsets\": [0, 4]}}", "dtype is a number"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4], \"extra\": 1}}",
       "unknown field 'extra'"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}",
       "tensor 'a' shape has a negative value -1"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", "not a non-negative integer"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": 1, \"data_offsets\": [0, 4]}}", "not an array"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [[1]], \"data_offsets\": [0, 4]}}", "holds an array"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}",
       "tensor 'a' data_offsets holds 1 values, expected two"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}",
       "tensor 'a' data_offsets holds more than two values"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"shape\": [1], \"data_offsets\": [0, 4]}}", "appears twice"},
      {"{\"a\": {\"dtype\": \"F12\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
       "dtype 'F12', which qtrain cannot read"},
      {"{\"a\": {\"dtype\": \"F4\", \"shape\": [8], \"data_offsets\": [0, 4]}}",
       "dtype 'F4', which qtrain cannot read"},
      {"{\"__metadata__\": {\"format\": 1}}", "__metadata__ value of 'format' is a number"},
      {"{\"__metadata__\": [1]}", "entry '__metadata__' is an array"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [99999999999999999999], \"data_offsets\": [0, 4]}}",
       "not a non-negative integer"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [9223372036854775808], \"data_offsets\": [0, 4]}}", "too large"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [01], \"data_offsets\": [0, 4]}}", "not valid JSON"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [\"\xff\"], \"data_offsets\": [0, 4]}}", "not valid JSON"},
      {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1" + sixty_four_more_dims + "], \"data_offsets\": [0, 4]}}",
       "tensor 'a' shape has more than 64 dimensions"},
      {deep, "not a JSON object"},
      {"{\"a\": " + deep + "}", "entry 'a' is an array"},
  };
  int index = 0;
  for (const auto& [header, expected] : cases) {
    SCOPED_TRACE(header.substr(0, 100));
    const auto path = directory.file("malformed-" + std::to_string(index++) + ".safetensors");
    write_bytes(path, safetensors_bytes(header, four_bytes));
    const auto message = open_error<SafetensorsFile>(path);
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
}

TEST(Safetensors, InconsistentOffsetsAreErrors) {
  TempDir directory;
  auto entry = [](const std::string& dtype, const std::string& shape, uint64_t begin, uint64_t end) {
    return "{\"dtype\": \"" + dtype + "\", \"shape\": " + shape + ", \"data_offsets\": [" + std::to_string(begin) +
           ", " + std::to_string(end) + "]}";
  };
  const std::vector<std::tuple<std::string, size_t, std::string>> cases{
      {"{\"a\": " + entry("F32", "[2]", 0, 8) + ", \"b\": " + entry("F32", "[2]", 4, 12) + "}", 12, "overlap"},
      {"{\"a\": " + entry("F32", "[2]", 0, 8) + ", \"b\": " + entry("F32", "[1]", 12, 16) + "}", 16,
       "leave bytes [8, 12)"},
      {"{\"a\": " + entry("F32", "[1]", 4, 8) + "}", 8, "leave bytes [0, 4)"},
      {"{\"a\": " + entry("F32", "[2]", 8, 0) + "}", 8, "end before they begin"},
      {"{\"a\": " + entry("F32", "[3]", 0, 8) + "}", 8, "12 bytes, but its data_offsets [0, 8] hold 8"},
      {"{\"a\": " + entry("BF16", "[4611686018427387904, 4]", 0, 8) + "}", 8, "larger than any file"},
      {"{\"a\": " + entry("F32", "[2]", 0, 8) + "}", 12, "trailing bytes"},
      {"{\"a\": " + entry("F32", "[2]", 0, 8) + "}", 4, "end past the file's data section (4 bytes)"},
      {"{\"a\": " + entry("U8", "[2]", 18446744073709551610ull, 18446744073709551612ull) + "}", 4, "leave bytes"},
      {"{\"a\": " + entry("F32", "[1]", 0, 4) + ", \"a\": " + entry("F32", "[1]", 4, 8) + "}", 8,
       "tensor 'a' appears twice"},
  };
  int index = 0;
  for (const auto& [header, data_bytes, expected] : cases) {
    SCOPED_TRACE(header);
    const auto path = directory.file("offsets-" + std::to_string(index++) + ".safetensors");
    write_bytes(path, safetensors_bytes(header, std::string(data_bytes, '\1')));
    const auto message = open_error<SafetensorsFile>(path);
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
}

TEST(Safetensors, ZeroSizedTensorsAndAnEmptyFileAreValid) {
  TempDir directory;
  const auto path = directory.file("zero.safetensors");
  write_bytes(path, safetensors_bytes("{\"a\": {\"dtype\": \"F32\", \"shape\": [0, 3], \"data_offsets\": [0, 0]}, "
                                      "\"b\": {\"dtype\": \"I8\", \"shape\": [2], \"data_offsets\": [0, 2]}}",
                                      "\x05\x06"));
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(file.tensor("a").sizes(), torch::IntArrayRef({0, 3}));
  EXPECT_EQ(file.tensor("b")[1].item<int8_t>(), 6);

  const auto empty = directory.file("empty.safetensors");
  write_safetensors(empty, {});
  EXPECT_TRUE(SafetensorsFile::open(empty).names().empty());
}

TEST(Safetensors, WriterRefusesWhatSafetensorsCannotHold) {
  TempDir directory;
  const auto path = directory.file("bad.safetensors");
  write_safetensors(path, {{"kept", torch::ones({2})}});
  const auto before = read_bytes(path);
  const std::vector<std::pair<Named, std::string>> cases{
      {{{"z", torch::ones({2}, torch::kComplexDouble)}}, "ComplexDouble, which safetensors cannot store"},
      {{{"a", torch::ones({2})}, {"a", torch::ones({2})}}, "given twice"},
      {{{"__metadata__", torch::ones({2})}}, "reserves that name"},
      {{{"u", torch::Tensor()}}, "undefined"},
  };
  for (const auto& [tensors, expected] : cases) {
    try {
      write_safetensors(path, tensors);
      ADD_FAILURE() << "no Error for " << expected;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
  }
  EXPECT_EQ(read_bytes(path), before) << "a refused write leaves the old file";
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_THROW(write_safetensors(directory.file("no/such/dir/x.safetensors"), {{"a", torch::ones({1})}}), Error);
}

TEST(SafetensorsCheckpoint, ReadsTheShardedForm) {
  TempDir directory;
  const Named tensors{{"model.embed_tokens.weight", random_tensor(torch::kBFloat16, {64, 16})},
                      {"model.norm.weight", random_tensor(torch::kFloat32, {16})},
                      {"lm_head.weight", random_tensor(torch::kBFloat16, {64, 16})}};
  // 2 KiB per embedding: the first shard takes it and the norm, the second lm_head.
  write_safetensors_checkpoint(directory.path(), tensors, /*max_shard_bytes=*/2200);
  EXPECT_TRUE(fs::exists(directory.file("model-00001-of-00002.safetensors")));
  EXPECT_TRUE(fs::exists(directory.file("model-00002-of-00002.safetensors")));
  EXPECT_FALSE(fs::exists(directory.file("model.safetensors")));
  std::ifstream index_stream(directory.file("model.safetensors.index.json"));
  const auto index = json::parse(index_stream);
  EXPECT_EQ(index["metadata"]["total_size"], 64 * 16 * 2 * 2 + 16 * 4);
  EXPECT_EQ(index["weight_map"]["lm_head.weight"], "model-00002-of-00002.safetensors");

  for (const auto& source : {directory.path(), directory.file("model.safetensors.index.json")}) {
    const auto checkpoint = SafetensorsCheckpoint::open(source);
    EXPECT_EQ(checkpoint.names(),
              (std::vector<std::string>{"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}));
    EXPECT_EQ(checkpoint.files().size(), 2u);
    for (const auto& [name, tensor] : tensors) {
      EXPECT_TRUE(checkpoint.contains(name));
      EXPECT_EQ(tensor_bytes(checkpoint.tensor(name)), tensor_bytes(tensor)) << name;
      EXPECT_EQ(checkpoint.info(name).shape, tensor.sizes().vec());
    }
    EXPECT_EQ(checkpoint.files()[0].metadata().at("format"), "pt");
  }

  // A later export that fits one file replaces the shards: no stale index is read.
  write_safetensors_checkpoint(directory.path(), tensors);
  EXPECT_FALSE(fs::exists(directory.file("model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(directory.file("model-00001-of-00002.safetensors")));
  const auto single = SafetensorsCheckpoint::open(directory.path());
  EXPECT_EQ(single.source(), directory.file("model.safetensors"));
  EXPECT_EQ(single.names().size(), 3u);
}

TEST(SafetensorsCheckpoint, ReadsTheFixtureModelAndAdapterFile) {
  const auto model = SafetensorsCheckpoint::open(fixture("tiny-llama"));
  EXPECT_EQ(model.names().size(), 39u);
  EXPECT_EQ(model.info("lm_head.weight").shape, (std::vector<int64_t>{8192, 256}));

  // A PEFT adapter directory holds one other *.safetensors; its path works as well.
  for (const auto& source : {fixture("tiny-llama-lora"), fixture("tiny-llama-lora/adapter_model.safetensors")}) {
    const auto adapter = SafetensorsCheckpoint::open(source);
    EXPECT_EQ(adapter.source(), fixture("tiny-llama-lora/adapter_model.safetensors"));
    EXPECT_EQ(adapter.names().size(), 4u * 7u * 2u);
    EXPECT_TRUE(adapter.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  }
  const auto message = open_error<SafetensorsCheckpoint>(fixture("tiny-llama-does-not-exist"));
  EXPECT_NE(message.find("tiny-llama-does-not-exist"), std::string::npos) << message;
  TempDir empty;
  EXPECT_NE(open_error<SafetensorsCheckpoint>(empty.path()).find("found neither model.safetensors"), std::string::npos);
}

TEST(SafetensorsCheckpoint, ShardIndexMustStayInsideTheDirectory) {
  TempDir directory;
  fs::create_directories(directory.file("model"));
  write_safetensors(directory.file("outside.safetensors"), {{"w", torch::ones({2})}});
  for (const auto& shard : std::vector<std::string>{"../outside.safetensors", directory.file("outside.safetensors"),
                                                    "sub/../../outside.safetensors", ""}) {
    SCOPED_TRACE(shard);
    const auto index_path = directory.file("model/model.safetensors.index.json");
    std::ofstream(index_path) << json{{"weight_map", {{"w", shard}}}}.dump();
    const auto message = open_error<SafetensorsCheckpoint>(directory.file("model"));
    EXPECT_NE(message.find(index_path), std::string::npos) << message;
    EXPECT_NE(message.find("outside the model directory"), std::string::npos) << message;
  }
}

TEST(SafetensorsCheckpoint, DamagedIndexesAreErrors) {
  TempDir directory;
  write_safetensors(directory.file("shard.safetensors"), {{"w", torch::ones({2})}});
  const std::vector<std::pair<std::string, std::string>> cases{
      {"not json", "not a safetensors index"},
      {"{\"metadata\": {}}", "not a safetensors index"},
      {"{\"weight_map\": {\"w\": 3}}", "is not a file name"},
      {"{\"weight_map\": {\"v\": \"shard.safetensors\"}}", "which does not hold it"},
      {"{\"weight_map\": {\"w\": \"missing.safetensors\"}}", "missing.safetensors: cannot open"},
      {std::string(1'000'000, '['), "nested deeper"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text.substr(0, 60));
    std::ofstream(directory.file("model.safetensors.index.json")) << text;
    const auto message = open_error<SafetensorsCheckpoint>(directory.path());
    EXPECT_NE(message.find(directory.path()), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace qtrain::trainer
