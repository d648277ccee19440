#pragma once
// HF tokenizers' normalizers: they rewrite each stretch of text between added tokens before
// the pre-tokenizer sees it. Supported: NFC (Qwen), NFD, StripAccents, Strip, ByteLevel,
// Prepend and Replace (sentencepiece-style files: Llama 2 writes Prepend("▁") then
// Replace(" " -> "▁"), Gemma Replace alone), and Sequence of these, applied in order. Not yet:
// Lowercase, NFKC, NFKD (they need Unicode case and compatibility tables); refused as not BPE's:
// BertNormalizer (WordPiece), Nmt and Precompiled (sentencepiece Unigram). Kept apart from tokenizer.cpp because added tokens with normalized = true are
// matched in their normalized form, so the added vocabulary needs the normalizer too.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/json_node.h"

namespace qtrain::data {

class NormalizerStep {
 public:
  virtual ~NormalizerStep() = default;
  virtual void apply(std::string& text) const = 0;
};

class Normalizer {
 public:
  // The "normalizer" value of tokenizer.json; null (nullopt) leaves text as it is. Error
  // naming the key for a normalizer we do not implement.
  static Normalizer from_json(const std::optional<JsonNode>& config);

  bool changes_nothing() const { return steps_.empty(); }
  std::string normalize(std::string_view text) const;

 private:
  std::vector<std::shared_ptr<const NormalizerStep>> steps_;
};

}  // namespace qtrain::data
