#pragma once
// Reads tokenizer.json. A real vocabulary is most of the file (Llama 3: 128k tokens and 280k
// merges in 17 MB; Gemma: 262k and 515k in 32 MB), and a JSON tree of it costs more than
// the rest of loading together: nlohmann's tree for Llama 3 takes 0.4 s to build and free.
// So the parse is streamed: model.vocab and model.merges go straight into flat lists, every
// other key into a small JSON document that the pipeline's parts read through JsonNode.
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

namespace qtrain::data {

// model.vocab and model.merges, as the file lists them. Deques: they grow to 500k entries
// without moving them all at each doubling.
struct BpeTables {
  std::deque<std::pair<std::string, int64_t>> vocab;      // (token, id) in file order
  std::deque<std::pair<std::string, std::string>> merges;  // (left, right) by rank
};

struct TokenizerFile {
  // The whole file, except that model.vocab (when an object) is an empty object and
  // model.merges (when an array) an empty array: their contents are in `tables`.
  nlohmann::json document;
  BpeTables tables;
};

// Error naming the file when it is missing or not JSON, and naming the key
// ("model.vocab[\"the\"]", "model.merges[3]") when a vocab id is not an integer or a merge is
// not "left right" or [left, right].
TokenizerFile read_tokenizer_file(const std::string& path);

}  // namespace qtrain::data
