#pragma once
// Pre-tokenised data in llm.c's .bin format: a header of 256 little-endian int32 (magic,
// version, token count, the rest zero), then the tokens. Two variants, as llm.c writes them:
//   magic 20240520, version 1: uint16 tokens (vocabularies up to 65,536 ids)
//   magic 20240801, version 7: uint32 tokens (Llama 3's 128k vocabulary)
// Documents follow each other in one stream; each starts with BOS.
#include <cstdint>
#include <string>
#include <vector>

namespace qtrain::data {

// All the tokens of FILE. Error naming the file for a wrong magic or version, a count the body
// does not hold, or a token at or above vocab_size.
std::vector<int64_t> read_token_file(const std::string& path, int64_t vocab_size);

// The bytes of a token file holding `tokens`, in the narrowest variant that holds every id
// below vocab_size (the caller writes them, e.g. atomically). Error for ids outside it.
std::string encode_token_file(const std::vector<int64_t>& tokens, int64_t vocab_size);

// The stream cut where each document starts (at every bos_id); without a BOS, one document.
std::vector<std::vector<int64_t>> split_documents(const std::vector<int64_t>& tokens, int64_t bos_id);

}  // namespace qtrain::data
