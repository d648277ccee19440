#pragma once
// Decoded text of a growing token sequence, piece by piece, for printing generated tokens as
// they come. Each piece is what the whole sequence's text adds to the text already given out;
// a token that ends inside a UTF-8 character (byte-level and byte-fallback tokens split them)
// is held back until the character is complete. Special tokens (EOS, end of turn) are skipped.
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace qtrain::data {

class StreamingDecoder {
 public:
  explicit StreamingDecoder(Tokenizer tokenizer) : tokenizer_(std::move(tokenizer)) {}
  // The new text that `token` completes (often empty for a partial character).
  std::string push(int64_t token);
  // Whatever is still held back, at the end of the sequence.
  std::string finish();

 private:
  std::string new_text(bool final);

  Tokenizer tokenizer_;
  std::vector<int64_t> tokens_;
  std::string emitted_;
};

}  // namespace qtrain::data
