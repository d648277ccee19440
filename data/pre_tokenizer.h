#pragma once
// HF tokenizers' pre-tokenizers: they cut a stretch of text (between added tokens) into the
// pre-tokens that BPE encodes one by one. Supported: Split (Regex or String pattern, every
// behavior, invert), ByteLevel (add_prefix_space, use_regex = GPT-2's pattern), Digits, and
// Sequence of these. Steps run in order on every piece, as in tokenizers: a step after
// ByteLevel sees the byte-level characters.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/json_node.h"

namespace qtrain::data {

class PreTokenizerStep {
 public:
  virtual ~PreTokenizerStep() = default;
  // Replaces `pieces` by the pieces each one splits into; no piece is empty.
  virtual void apply(std::vector<std::string>& pieces) const = 0;
};

class PreTokenizer {
 public:
  // The "pre_tokenizer" value of tokenizer.json; null (nullopt) gives the text as one piece.
  static PreTokenizer from_json(const std::optional<JsonNode>& config);

  std::vector<std::string> split(std::string_view text) const;

 private:
  std::vector<std::shared_ptr<const PreTokenizerStep>> steps_;
};

}  // namespace qtrain::data
