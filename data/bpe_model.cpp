#include "data/bpe_model.h"

#include <algorithm>
#include <climits>
#include <functional>
#include <mutex>
#include <queue>

#include "data/utf8.h"
#include "kernels/error.h"

namespace qtrain::data {

namespace {

// Sentencepiece's word marker, U+2581, which stands for a space in sentencepiece-style vocabularies.
constexpr std::string_view kWordMarker = "\u2581";

}  // namespace

BpeModel::BpeModel(const JsonNode& config, BpeTables tables) {
  const JsonNode type = config.at("type");
  if (type.as_string() != "BPE") {
    type.fail("'" + type.as_string() + "' is not supported (expected 'BPE': qtrain reads BPE tokenizers, byte-level "
              "as Llama 3's or sentencepiece-style as Llama 2's; Unigram and WordPiece models are not implemented)");
  }
  if (auto dropout = config.find("dropout"); dropout && dropout->as_number() != 0.0) {
    dropout->fail("is not supported (BPE dropout randomises tokenization; set it to null)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (auto affix = config.find(key); affix && !affix->as_string().empty()) {
      affix->fail("'" + affix->as_string() + "' is not supported (Llama-family BPE tokenizers leave it null)");
    }
  }
  ignore_merges_ = config.bool_or("ignore_merges", false);
  fuse_unknown_ = config.bool_or("fuse_unk", false);
  byte_fallback_ = config.bool_or("byte_fallback", false);

  const JsonNode vocab = config.at("vocab");
  if (!vocab.value().is_object()) vocab.fail("must be an object of token: id");
  int64_t largest_id = -1;
  vocab_.reserve(tables.vocab.size());
  for (auto& [token, id] : tables.vocab) {
    if (id < 0 || id > INT32_MAX) vocab.fail("has the id " + std::to_string(id) + " for '" + token + "' (ids must be 0..2^31)");
    // A repeated token keeps its last id, as a JSON object's repeated key does.
    vocab_.insert_or_assign(std::move(token), static_cast<int32_t>(id));
    largest_id = std::max(largest_id, id);
  }
  tokens_.assign(static_cast<size_t>(largest_id + 1), std::string());
  id_in_vocab_.assign(tokens_.size(), false);
  single_character_id_.fill(-1);
  for (const auto& [token, id] : vocab_.entries()) {
    tokens_[id] = token;
    id_in_vocab_[id] = true;
    const utf8::Character first = utf8::character_at(token, 0);
    if (!token.empty() && first.length == token.size() && first.code_point < single_character_id_.size()) {
      single_character_id_[first.code_point] = id;
    }
  }

  static const char* const kHexDigits = "0123456789ABCDEF";
  for (int byte = 0; byte < 256; ++byte) {
    const std::string token = std::string("<0x") + kHexDigits[byte >> 4] + kHexDigits[byte & 15] + ">";
    const int32_t* id = vocab_.find(token);
    byte_token_id_[byte] = id == nullptr ? -1 : *id;
  }

  if (auto unknown = config.find("unk_token")) {
    const std::string token = unknown->as_string();
    const int32_t* id = vocab_.find(token);
    if (id == nullptr) unknown->fail("'" + token + "' is not in model.vocab");
    unknown_id_ = *id;
  }
  read_merges(config.at("merges"), tables.merges);
  find_word_cuts_joined_in_tokens();
}

void BpeModel::read_merges(const JsonNode& merges, const std::deque<std::pair<std::string, std::string>>& pairs) {
  if (!merges.value().is_array()) merges.fail("must be a JSON array of merges, got " + std::string(merges.value().type_name()));
  const size_t count = pairs.size();
  // Each lookup below waits on memory (the vocabulary and the merge table are megabytes), so
  // the slots wanted a few merges ahead are requested while the current one is looked up.
  constexpr size_t kPrefetchDistance = 8;
  std::string merged_ahead;
  std::vector<int32_t> merged_ids(count);
  merge_list_.reserve(count);
  for (size_t rank = 0; rank < count; ++rank) {
    if (rank + kPrefetchDistance < count) {
      const auto& [left_ahead, right_ahead] = pairs[rank + kPrefetchDistance];
      merged_ahead.assign(left_ahead).append(right_ahead);
      vocab_.prefetch(std::string_view(left_ahead));
      vocab_.prefetch(std::string_view(right_ahead));
      vocab_.prefetch(std::string_view(merged_ahead));
    }
    const auto& [left, right] = pairs[rank];
    const auto left_id = token_to_id(left);
    const auto right_id = token_to_id(right);
    const auto merged_id = token_to_id(left + right);
    if (!left_id || !right_id || !merged_id) {
      const std::string& missing = !left_id ? left : !right_id ? right : left + right;
      const JsonNode entry(merges.value(), merges.file(), merges.path() + "[" + std::to_string(rank) + "]");
      entry.fail("merges '" + left + "' and '" + right + "', but '" + missing + "' is not in model.vocab");
    }
    merge_list_.emplace_back(static_cast<int32_t>(*left_id), static_cast<int32_t>(*right_id));
    merged_ids[rank] = static_cast<int32_t>(*merged_id);
  }
  merges_.reserve(count);
  for (size_t rank = 0; rank < count; ++rank) {
    if (rank + kPrefetchDistance < count) {
      const auto& [left_ahead, right_ahead] = merge_list_[rank + kPrefetchDistance];
      merges_.prefetch(pair_key(left_ahead, right_ahead));
    }
    // A repeated pair keeps its last rank, as tokenizers' HashMap collect does.
    merges_.insert_or_assign(pair_key(merge_list_[rank].first, merge_list_[rank].second),
                             Merge{static_cast<int32_t>(rank), merged_ids[rank]});
  }
}

std::vector<std::pair<std::string, std::string>> BpeModel::merges() const {
  std::vector<std::pair<std::string, std::string>> listed;
  listed.reserve(merge_list_.size());
  for (const auto& [left, right] : merge_list_) listed.emplace_back(tokens_[left], tokens_[right]);
  return listed;
}

std::optional<int64_t> BpeModel::token_to_id(const std::string& token) const {
  const int32_t* id = vocab_.find(std::string_view(token));
  if (id == nullptr) return std::nullopt;
  return *id;
}

const std::string* BpeModel::id_to_token(int64_t id) const {
  if (id < 0 || id >= id_limit() || !id_in_vocab_[id]) return nullptr;
  return &tokens_[id];
}

std::vector<int32_t> BpeModel::merge_word(std::string_view piece) const {
  // The word as a doubly linked list of symbols; merged-away symbols get length 0.
  struct Symbol {
    int32_t id;
    int32_t previous;
    int32_t next;
    bool removed;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  auto add_symbol = [&](int32_t id) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1, false});
  };
  // tokenizers' merge_word holds an unknown character back until the next known one (or the
  // end), so that fuse_unk can extend it; byte-fallback tokens do not release it.
  bool unknown_pending = false;
  for (size_t position = 0; position < piece.size();) {
    const utf8::Character character = utf8::character_at(piece, position);
    int32_t id = character.code_point < single_character_id_.size() ? single_character_id_[character.code_point] : -1;
    if (id < 0 && character.code_point >= single_character_id_.size()) {
      const int32_t* found = vocab_.find(piece.substr(position, character.length));
      if (found != nullptr) id = *found;
    }
    const std::string_view bytes(piece.data() + position, character.length);
    position += character.length;
    if (id >= 0) {
      if (unknown_pending) add_symbol(*unknown_id_);
      unknown_pending = false;
      add_symbol(id);
      continue;
    }
    if (byte_fallback_ && std::all_of(bytes.begin(), bytes.end(),
                                      [&](char byte) { return byte_token_id_[static_cast<uint8_t>(byte)] >= 0; })) {
      for (const char byte : bytes) add_symbol(byte_token_id_[static_cast<uint8_t>(byte)]);
      continue;
    }
    // Without unk_token an unknown character is dropped, as in tokenizers.
    if (!unknown_id_) continue;
    if (unknown_pending && !fuse_unknown_) add_symbol(*unknown_id_);
    unknown_pending = true;
  }
  if (unknown_pending) add_symbol(*unknown_id_);
  if (symbols.empty()) return {};
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int32_t position;
    int32_t merged_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto find_merge = [&](int32_t left, int32_t right) -> const Merge* {
    return merges_.find(pair_key(symbols[left].id, symbols[right].id));
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) {
    if (const Merge* merge = find_merge(i, i + 1)) queue.push({merge->rank, i, merge->merged_id});
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.position];
    if (left.removed || left.next < 0) continue;
    // Skip entries made stale by an earlier merge of either side.
    const Merge* current = find_merge(top.position, left.next);
    if (current == nullptr || current->merged_id != top.merged_id) continue;
    Symbol& right = symbols[left.next];
    left.id = top.merged_id;
    right.removed = true;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].previous = top.position;
    if (left.previous >= 0) {
      if (const Merge* merge = find_merge(left.previous, top.position)) {
        queue.push({merge->rank, left.previous, merge->merged_id});
      }
    }
    if (left.next >= 0) {
      if (const Merge* merge = find_merge(top.position, left.next)) queue.push({merge->rank, top.position, merge->merged_id});
    }
  }
  std::vector<int32_t> ids;
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  return ids;
}

void BpeModel::encode(const std::string& piece, std::vector<int64_t>& ids) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    // A pre-token that is itself a token is taken whole, without merging (Llama 3).
    if (const int32_t* id = vocab_.find(std::string_view(piece))) {
      ids.push_back(*id);
      return;
    }
  }
  if (!cuts_words_) {
    encode_word(piece, ids);
    return;
  }
  // Without a pre-tokenizer (Gemma's and Llama 2's files) a piece is all the text between two
  // added tokens. Cut into words it gives the same ids, as no merge can cross a cut (no token
  // spans one), and each word is short and repeats: it is merged once and then cached.
  const std::string_view text(piece);
  size_t word_begin = 0;
  for (size_t marker = text.find(kWordMarker, 1); marker != std::string_view::npos;
       marker = text.find(kWordMarker, marker + kWordMarker.size())) {
    if (!is_word_cut(text, marker)) continue;
    encode_word(text.substr(word_begin, marker - word_begin), ids);
    word_begin = marker;
  }
  encode_word(text.substr(word_begin), ids);
}

void BpeModel::encode_word(std::string_view word, std::vector<int64_t>& ids) const {
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::shared_lock lock(cache_mutex_);
    if (auto hit = cache_.find(key); hit != cache_.end()) {
      ids.insert(ids.end(), hit->second.begin(), hit->second.end());
      return;
    }
  }
  std::vector<int32_t> word_ids = merge_word(word);
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::move(key), std::move(word_ids));
  }
}

void BpeModel::find_word_cuts_joined_in_tokens() {
  cuts_words_ = vocab_.find(kWordMarker) != nullptr;
  for (const auto& [token, id] : vocab_.entries()) {
    for (size_t marker = token.find(kWordMarker, 1); marker != std::string::npos;
         marker = token.find(kWordMarker, marker + kWordMarker.size())) {
      const size_t previous = utf8::start_of_character_before(token, marker);
      const char32_t character = utf8::character_at(token, previous).code_point;
      if (token.compare(previous, kWordMarker.size(), kWordMarker) != 0) characters_joined_to_word_marker_.insert(character);
    }
  }
}

bool BpeModel::is_word_cut(std::string_view piece, size_t position) const {
  // The character before must be a token of its own: one that falls back to bytes or to
  // unk_token could join the next symbol (byte tokens, fused unknowns).
  const size_t previous = utf8::start_of_character_before(piece, position);
  const utf8::Character character = utf8::character_at(piece, previous);
  if (previous + character.length != position || piece.compare(previous, kWordMarker.size(), kWordMarker) == 0) return false;
  if (characters_joined_to_word_marker_.count(character.code_point) > 0) return false;
  if (character.code_point < single_character_id_.size()) return single_character_id_[character.code_point] >= 0;
  return vocab_.find(piece.substr(previous, character.length)) != nullptr;
}

}  // namespace qtrain::data
