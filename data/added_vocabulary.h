#pragma once
// The added tokens of tokenizer.json ("added_tokens": special tokens such as
// <|begin_of_text|>, and any user-added ones). As in HF tokenizers they are found in the raw
// text before pre-tokenization, leftmost-longest first, and become one id each, whatever
// add_special_tokens says; the text between them goes through the pre-tokenizer and BPE.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "data/bpe_model.h"
#include "data/json_node.h"
#include "data/normalizer.h"

namespace qtrain::data {

struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool special = false;
  bool single_word = false;  // only matched between non-word characters
  bool lstrip = false;       // swallows the whitespace before it
  bool rstrip = false;       // swallows the whitespace after it
  bool normalized = false;   // matched in normalized text (a second pass)
  // What is matched and what decode shows: the content, run through the tokenizer's
  // normalizer when normalized is true (Llama 2's Prepend makes "hello" "▁hello").
  std::string normalized_content;
};

// A stretch of input: either one added token (id set) or plain text to pre-tokenize.
struct TextPiece {
  std::string_view text;
  std::optional<int64_t> added_token_id;
};

class AddedVocabulary {
 public:
  AddedVocabulary() = default;
  // The "added_tokens" array of tokenizer.json (absent or null: none). Ids are assigned as
  // tokenizers assigns them, not read from the file: a content already in the model's vocab
  // keeps that id, a new one gets the next id after the vocab and the added tokens so far
  // (in a consistent file these are the ids written there).
  static AddedVocabulary from_json(const std::optional<JsonNode>& added_tokens, const BpeModel& model,
                                   const Normalizer& normalizer);

  // As tokenizers does, added tokens are found in two passes: tokens with normalized=false
  // in the raw text, then, after the normalizer has run on the plain stretches between
  // them, tokens with normalized=true.
  enum class Pass { kRawText, kNormalizedText };
  // The text cut at every added token of one pass.
  std::vector<TextPiece> split(std::string_view text, Pass pass) const;

  const AddedToken* find(int64_t id) const;
  std::optional<int64_t> token_to_id(const std::string& content) const;
  // Whether `token` is the content of a special token: decode with skip_special_tokens drops
  // a token string by this test, as tokenizers does.
  bool is_special_content(const std::string& token) const { return special_contents_.count(token) > 0; }
  int64_t id_limit() const { return id_limit_; }  // one past the largest added id, 0 when none

 private:
  // A byte trie over the contents of one set of tokens, for leftmost-longest matching.
  class Matcher {
   public:
    void add(const std::string& content, size_t token_index);
    bool empty() const { return nodes_.size() <= 1; }
    // The longest token starting at text[position], as an index into tokens_, or -1.
    int64_t longest_at(std::string_view text, size_t position) const;

   private:
    struct Node {
      std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
      int64_t token_index = -1;
    };
    std::vector<Node> nodes_{Node{}};
    bool first_bytes_[256] = {};
  };

  std::vector<AddedToken> tokens_;
  std::unordered_map<int64_t, size_t> index_of_id_;
  std::unordered_map<std::string, size_t> index_of_content_;
  std::unordered_set<std::string> special_contents_;
  int64_t id_limit_ = 0;
  Matcher raw_matcher_;
  Matcher normalized_matcher_;
};

}  // namespace qtrain::data
