#pragma once
// The "pattern" of tokenizer.json's Split pre-tokenizer and Replace normalizer / decoder:
// {"String": "..."}, a literal, or {"Regex": "..."}, a regular expression (Oniguruma in HF
// tokenizers, PCRE2 here: the same syntax for the patterns tokenizer files use). One type for
// all three, so that they find matches the same way.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/json_node.h"
#include "data/unicode_regex.h"

namespace qtrain::data {

class TextPattern {
 public:
  // Error naming the key when `pattern` holds neither a "String" nor a "Regex", or the regex
  // does not compile.
  explicit TextPattern(const JsonNode& pattern);
  static TextPattern literal(std::string text);
  // A pattern of our own (the fixed ones of tokenizers' Whitespace, Punctuation...); `where`
  // names it in the error should it not compile.
  static TextPattern regex(const std::string& pattern, const std::string& where);

  // The non-overlapping, non-empty matches, left to right. An empty literal matches nothing.
  std::vector<TextSpan> find_all(std::string_view text) const;

 private:
  TextPattern() = default;
  std::shared_ptr<const UnicodeRegex> regex_;
  std::string literal_;
};

// `text` with every match of `pattern` replaced by `content`.
std::string replace_all(std::string_view text, const TextPattern& pattern, std::string_view content);

}  // namespace qtrain::data
