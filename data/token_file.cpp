#include "data/token_file.h"

#include <array>
#include <cstring>
#include <fstream>

#include "kernels/error.h"

namespace qtrain::data {

namespace {

constexpr int kHeaderInts = 256;

struct TokenFileVariant {
  int32_t magic;
  int32_t version;
  int token_bytes;
  int64_t id_limit;  // ids below this fit
};

// llm.c's dev/data/data_common.py, "gpt-2" and "llama-3".
constexpr TokenFileVariant kVariants[] = {
    {20240520, 1, 2, int64_t{1} << 16},
    {20240801, 7, 4, int64_t{1} << 32},
};

uint32_t little_endian(const unsigned char* bytes, int width) {
  uint32_t value = 0;
  for (int i = width - 1; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

}  // namespace

std::vector<int64_t> read_token_file(const std::string& path, int64_t vocab_size) {
  std::ifstream input(path, std::ios::binary);
  if (!input) throw Error(ErrorCode::kData, path + ": cannot open (expected an llm.c .bin token file)");
  std::array<unsigned char, kHeaderInts * 4> header{};
  input.read(reinterpret_cast<char*>(header.data()), header.size());
  if (input.gcount() != static_cast<std::streamsize>(header.size())) {
    throw Error(ErrorCode::kData, path + ": shorter than the 1024-byte header of an llm.c token file");
  }
  const auto magic = static_cast<int32_t>(little_endian(header.data(), 4));
  const auto version = static_cast<int32_t>(little_endian(header.data() + 4, 4));
  const int64_t count = little_endian(header.data() + 8, 4);
  const TokenFileVariant* variant = nullptr;
  for (const auto& candidate : kVariants) {
    if (candidate.magic == magic) variant = &candidate;
  }
  if (variant == nullptr) {
    throw Error(ErrorCode::kData, path + ": magic number " + std::to_string(magic) +
                " is not an llm.c token file's (20240520 for uint16 tokens, 20240801 for uint32)");
  }
  if (variant->version != version) {
    throw Error(ErrorCode::kData, path + ": version " + std::to_string(version) + " with magic " + std::to_string(magic) +
                ", expected version " + std::to_string(variant->version));
  }
  // The size is checked before anything is allocated: a damaged header cannot ask for 16 GB.
  const std::streamoff body_start = input.tellg();
  input.seekg(0, std::ios::end);
  const int64_t body_bytes = static_cast<int64_t>(input.tellg() - body_start);
  input.seekg(body_start);
  if (body_bytes != count * variant->token_bytes) {
    throw Error(ErrorCode::kData, path + ": the header promises " + std::to_string(count) + " tokens of " +
                std::to_string(variant->token_bytes) + " bytes but the body holds " + std::to_string(body_bytes) +
                " bytes (" + (body_bytes < count * variant->token_bytes ? "truncated?" : "trailing bytes") + ")");
  }
  std::vector<unsigned char> body(static_cast<size_t>(body_bytes));
  input.read(reinterpret_cast<char*>(body.data()), static_cast<std::streamsize>(body.size()));
  if (input.gcount() != static_cast<std::streamsize>(body.size())) throw Error(ErrorCode::kData, path + ": read error");
  std::vector<int64_t> tokens(static_cast<size_t>(count));
  for (int64_t index = 0; index < count; ++index) {
    tokens[index] = little_endian(body.data() + index * variant->token_bytes, variant->token_bytes);
    if (tokens[index] >= vocab_size) {
      throw Error(ErrorCode::kData, path + ": token " + std::to_string(index) + " is " + std::to_string(tokens[index]) +
                  ", outside the tokenizer's vocabulary of " + std::to_string(vocab_size) +
                  " (was the file made with another tokenizer?)");
    }
  }
  return tokens;
}

std::string encode_token_file(const std::vector<int64_t>& tokens, int64_t vocab_size) {
  const TokenFileVariant& variant = vocab_size <= kVariants[0].id_limit ? kVariants[0] : kVariants[1];
  if (tokens.size() > 0x7fffffffu) {
    throw Error(ErrorCode::kData, std::to_string(tokens.size()) + " tokens do not fit one llm.c token file; split the data");
  }
  std::string bytes(kHeaderInts * 4 + tokens.size() * variant.token_bytes, '\0');
  auto put = [&](size_t offset, uint32_t value, int width) {
    for (int i = 0; i < width; ++i) bytes[offset + i] = static_cast<char>((value >> (8 * i)) & 0xff);
  };
  put(0, static_cast<uint32_t>(variant.magic), 4);
  put(4, static_cast<uint32_t>(variant.version), 4);
  put(8, static_cast<uint32_t>(tokens.size()), 4);
  for (size_t index = 0; index < tokens.size(); ++index) {
    if (tokens[index] < 0 || tokens[index] >= vocab_size) {
      throw Error(ErrorCode::kData, "token id " + std::to_string(tokens[index]) + " is outside the vocabulary of " +
                  std::to_string(vocab_size));
    }
    put(kHeaderInts * 4 + index * variant.token_bytes, static_cast<uint32_t>(tokens[index]), variant.token_bytes);
  }
  return bytes;
}

std::vector<std::vector<int64_t>> split_documents(const std::vector<int64_t>& tokens, int64_t bos_id) {
  std::vector<std::vector<int64_t>> documents;
  for (const int64_t token : tokens) {
    if (documents.empty() || (token == bos_id && !documents.back().empty())) documents.emplace_back();
    documents.back().push_back(token);
  }
  return documents;
}

}  // namespace qtrain::data
