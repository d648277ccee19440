#include "data/streaming_decoder.h"

#include "data/text_affixes.h"

namespace qtrain::data {

namespace {

// U+FFFD, what decoding gives for bytes that do not (yet) form a character.
const std::string kReplacementCharacter = "\xEF\xBF\xBD";

}  // namespace

std::string StreamingDecoder::push(int64_t token) {
  tokens_.push_back(token);
  return new_text(/*final=*/false);
}

std::string StreamingDecoder::finish() { return new_text(/*final=*/true); }

std::string StreamingDecoder::new_text(bool final) {
  const std::string text = tokenizer_.decode(tokens_, /*skip_special_tokens=*/true);
  if (!final && ends_with(text, kReplacementCharacter)) return "";
  // Decoding is append-only for byte-level BPE; should a decoder rewrite earlier text (a
  // sentencepiece leading space), only what lies beyond the text given out is new.
  if (text.size() <= emitted_.size()) return "";
  std::string piece = text.substr(emitted_.size());
  emitted_ = text;
  return piece;
}

}  // namespace qtrain::data
