#pragma once
// HF tokenizers' pre-tokenizers: they cut a stretch of text (between added tokens) into the
// pre-tokens that BPE encodes one by one. Supported: Split (Regex or String pattern, every
// behavior, invert), ByteLevel (add_prefix_space, use_regex = GPT-2's pattern), Digits,
// Metaspace (spaces become "▁", a "▁" prepended, optionally split before each "▁": the
// sentencepiece style of Mistral and transformers' legacy=false Llama files), and Sequence of
// these, and tokenizers' fixed splits: Punctuation (Falcon), Whitespace, WhitespaceSplit,
// BertPreTokenizer, CharDelimiterSplit. UnicodeScripts and FixedLength, which no language
// model's file uses, are refused by name. Steps run in order on every piece, as in
// tokenizers: a step after ByteLevel sees the byte-level characters.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/json_node.h"

namespace qtrain::data {

// The options of tokenizers' Metaspace, which is a pre-tokenizer and a decoder both.
enum class PrependScheme {
  kAlways,  // "▁" before every stretch of text that does not start with one
  kFirst,   // only before the stretch at the very start of the input (not after an added token)
  kNever,
};
struct MetaspaceOptions {
  std::string replacement = "\u2581";  // one character, as UTF-8
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;  // pre-tokenizer: a new piece before every replacement character

  // Error naming the key for a replacement that is not one character or an unknown scheme.
  static MetaspaceOptions from_json(const JsonNode& config);
};

// The pieces of one stretch of text, in order, none empty.
struct PreTokenizedText {
  std::vector<std::string> pieces;
  // Whether pieces[0] begins where the whole input begins: prepend_scheme "first" tests that
  // (tokenizers looks at the piece's offset in the original text).
  bool first_piece_starts_input = false;
};

class PreTokenizerStep {
 public:
  virtual ~PreTokenizerStep() = default;
  virtual void apply(PreTokenizedText& text) const = 0;
};

class PreTokenizer {
 public:
  // The "pre_tokenizer" value of tokenizer.json; null (nullopt) gives the text as one piece.
  static PreTokenizer from_json(const std::optional<JsonNode>& config);

  // `starts_input`: `text` begins at offset 0 of what was passed to Tokenizer::encode.
  std::vector<std::string> split(std::string_view text, bool starts_input) const;

 private:
  std::vector<std::shared_ptr<const PreTokenizerStep>> steps_;
};

}  // namespace qtrain::data
