#pragma once
// The BPE model of an HF tokenizer.json ("model": {"type": "BPE", ...}): a vocabulary of
// token strings and a ranked list of merges. A pre-token is split into characters, each
// looked up in the vocabulary, then the adjacent pair of lowest merge rank is merged, again
// and again, as tokenizers' Word::merge_all does (leftmost first among equal ranks).
// A character not in the vocabulary becomes, in this order of preference, its UTF-8 bytes as
// the tokens <0xXX> (byte_fallback: sentencepiece-style files such as Llama 2's), unk_token
// (one per character, or one per run with fuse_unk), or nothing.
#include <array>
#include <cstdint>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "data/flat_hash_map.h"
#include "data/json_node.h"
#include "data/tokenizer_file.h"

namespace qtrain::data {

class BpeModel {
 public:
  // The "model" value of tokenizer.json and its vocab and merges (read_tokenizer_file keeps
  // them out of the JSON document). Error naming the key for a model type other than BPE or
  // an option we do not implement (dropout, subword prefixes).
  BpeModel(const JsonNode& config, BpeTables tables);
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one pre-token. Thread-safe (it caches results behind a lock).
  void encode(const std::string& piece, std::vector<int64_t>& ids) const;

  std::optional<int64_t> token_to_id(const std::string& token) const;
  // The token string of an id, or nullptr when the vocabulary has no such id.
  const std::string* id_to_token(int64_t id) const;
  // Number of tokens in the vocabulary (tokenizers' get_vocab_size).
  size_t vocab_count() const { return vocab_.size(); }
  // One past the largest id in the vocabulary.
  int64_t id_limit() const { return static_cast<int64_t>(tokens_.size()); }
  // The merges as the file lists them, by rank: (left token, right token).
  std::vector<std::pair<std::string, std::string>> merges() const;

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  void read_merges(const JsonNode& merges, const std::deque<std::pair<std::string, std::string>>& pairs);
  std::vector<int32_t> merge_word(std::string_view word) const;
  // Appends the ids of a word that merges on its own, through the cache.
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const;
  void find_word_cuts_joined_in_tokens();
  // Whether a piece may be cut before the word marker at `position` (see encode).
  bool is_word_cut(std::string_view piece, size_t position) const;

  FlatHashMap<std::string, int32_t, std::hash<std::string_view>> vocab_;
  std::vector<std::string> tokens_;   // by id
  std::vector<bool> id_in_vocab_;     // false for holes in the id range
  std::array<int32_t, 512> single_character_id_;  // id of each one-character token below U+0200, else -1
  FlatHashMap<uint64_t, Merge> merges_;           // (left id, right id) -> rank and merged id
  std::vector<std::pair<int32_t, int32_t>> merge_list_;  // (left id, right id) by rank, as in the file
  bool ignore_merges_ = false;
  std::optional<int32_t> unknown_id_;
  bool fuse_unknown_ = false;
  bool byte_fallback_ = false;
  std::array<int32_t, 256> byte_token_id_;  // id of "<0xXX>" for each byte, -1 when not in the vocab
  // Sentencepiece's word marker "▁" is a token, so pieces are cut into words before it...
  bool cuts_words_ = false;
  // ...except after these characters, which precede "▁" inside some token (Gemma: ">", of ">▁</").
  std::unordered_set<char32_t> characters_joined_to_word_marker_;

  // Pre-tokens repeat a lot in natural text; their ids are kept (up to kCacheCapacity words).
  static constexpr size_t kCacheCapacity = 100000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace qtrain::data
