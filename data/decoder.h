#pragma once
// HF tokenizers' decoders: they turn the token strings of a list of ids back into text.
// Supported: ByteLevel (byte-level BPE: Llama 3, GPT-2, Qwen), the sentencepiece-style steps
// Replace, ByteFallback ("<0xE6>" tokens back to bytes), Fuse, Strip and Metaspace (Llama 2,
// Mistral), BPEDecoder (an end-of-word suffix such as "</w>"), and Sequence of these; WordPiece
// and CTC are refused (not BPE's); without a decoder the tokens are joined with spaces. As in
// tokenizers, each step maps the list of token strings to a new list, and the last list is
// concatenated.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/json_node.h"

namespace qtrain::data {

class DecoderStep {
 public:
  virtual ~DecoderStep() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

class Decoder {
 public:
  // The "decoder" value of tokenizer.json (null: nullopt). Error naming the key for a decoder
  // we do not implement.
  static Decoder from_json(const std::optional<JsonNode>& config);

  std::string decode(std::vector<std::string> tokens) const;

 private:
  bool join_with_spaces_ = false;  // no decoder in the file
  std::vector<std::shared_ptr<const DecoderStep>> steps_;
};

}  // namespace qtrain::data
