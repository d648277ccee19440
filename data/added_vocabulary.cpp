#include "data/added_vocabulary.h"

#include <algorithm>

#include "data/unicode_regex.h"
#include "data/utf8.h"

namespace qtrain::data {

namespace {

// Where the character that ends at text[end] begins (end > 0). Invalid bytes count alone.
size_t previous_character_start(std::string_view text, size_t end) {
  size_t start = end - 1;
  while (start > 0 && end - start < 4 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  return utf8::character_at(text, start).length == end - start ? start : end - 1;
}

// The start of the whitespace run that ends at text[end] (tokens with lstrip take it).
size_t whitespace_run_start(std::string_view text, size_t end) {
  size_t start = end;
  while (start > 0) {
    const size_t previous = previous_character_start(text, start);
    if (!utf8::is_whitespace(utf8::character_at(text, previous).code_point)) break;
    start = previous;
  }
  return start;
}

// The end of the whitespace run that starts at text[begin] (tokens with rstrip take it).
size_t whitespace_run_end(std::string_view text, size_t begin) {
  size_t position = begin;
  while (position < text.size()) {
    const utf8::Character c = utf8::character_at(text, position);
    if (!utf8::is_whitespace(c.code_point)) break;
    position += c.length;
  }
  return position;
}

// Rust regex's \w, which tokenizers uses for single_word: Alphabetic (letters, letter
// numbers, the marks and circled letters of Other_Alphabetic), marks, decimal digits,
// connector punctuation and the joiners.
bool is_word_character(std::string_view character) {
  static const UnicodeRegex word(
      R"([\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}\x{24B6}-\x{24E9}\x{1F130}-\x{1F149}\x{1F150}-\x{1F169}\x{1F170}-\x{1F189}])",
      "word-character pattern");
  return !character.empty() && !word.find_all(character).empty();
}

std::string_view last_character(std::string_view text) {
  if (text.empty()) return text;
  return text.substr(previous_character_start(text, text.size()));
}

std::string_view first_character(std::string_view text) {
  if (text.empty()) return text;
  return text.substr(0, utf8::character_at(text, 0).length);
}

}  // namespace

void AddedVocabulary::Matcher::add(const std::string& content, size_t token_index) {
  if (content.empty()) return;
  int32_t node = 0;
  for (const char byte_char : content) {
    const auto byte = static_cast<unsigned char>(byte_char);
    auto& children = nodes_[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
    if (it != children.end() && it->first == byte) {
      node = it->second;
    } else {
      const auto child = static_cast<int32_t>(nodes_.size());
      children.insert(it, {byte, child});
      nodes_.emplace_back();
      node = child;
    }
  }
  nodes_[node].token_index = static_cast<int64_t>(token_index);
  first_bytes_[static_cast<unsigned char>(content[0])] = true;
}

int64_t AddedVocabulary::Matcher::longest_at(std::string_view text, size_t position) const {
  if (!first_bytes_[static_cast<unsigned char>(text[position])]) return -1;
  int64_t longest = -1;
  int32_t node = 0;
  for (size_t i = position; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto& children = nodes_[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
    if (it == children.end() || it->first != byte) break;
    node = it->second;
    if (nodes_[node].token_index >= 0) longest = nodes_[node].token_index;
  }
  return longest;
}

AddedVocabulary AddedVocabulary::from_json(const std::optional<JsonNode>& added_tokens, const BpeModel& model,
                                           const Normalizer& normalizer) {
  AddedVocabulary vocabulary;
  if (!added_tokens) return vocabulary;
  const auto model_vocab_size = static_cast<int64_t>(model.vocab_count());
  for (size_t i = 0; i < added_tokens->size(); ++i) {
    const JsonNode entry = added_tokens->at(i);
    AddedToken token;
    entry.at("id").as_integer();  // checked for type; the id is derived below
    token.content = entry.at("content").as_string();
    if (token.content.empty()) entry.at("content").fail("must not be empty");
    token.special = entry.bool_or("special", false);
    token.single_word = entry.bool_or("single_word", false);
    token.lstrip = entry.bool_or("lstrip", false);
    token.rstrip = entry.bool_or("rstrip", false);
    token.normalized = entry.bool_or("normalized", !token.special);
    token.normalized_content = token.normalized ? normalizer.normalize(token.content) : token.content;

    if (auto existing = vocabulary.token_to_id(token.content)) {
      token.id = *existing;
    } else if (auto in_model = model.token_to_id(token.content)) {
      token.id = *in_model;
    } else {
      const int64_t largest = vocabulary.id_limit_ - 1;
      token.id = vocabulary.tokens_.empty() || largest < model_vocab_size ? model_vocab_size : largest + 1;
    }
    vocabulary.id_limit_ = std::max(vocabulary.id_limit_, token.id + 1);
    const size_t index = vocabulary.tokens_.size();
    vocabulary.index_of_id_[token.id] = index;
    vocabulary.index_of_content_[token.content] = index;
    if (token.special) vocabulary.special_contents_.insert(token.content);
    if (token.normalized) {
      vocabulary.normalized_matcher_.add(token.normalized_content, index);
    } else {
      vocabulary.raw_matcher_.add(token.content, index);
    }
    vocabulary.tokens_.push_back(std::move(token));
  }
  return vocabulary;
}

std::vector<TextPiece> AddedVocabulary::split(std::string_view text, Pass pass) const {
  const Matcher& matcher = pass == Pass::kRawText ? raw_matcher_ : normalized_matcher_;
  std::vector<TextPiece> out;
  if (matcher.empty()) {
    if (!text.empty()) out.push_back({text, std::nullopt});
    return out;
  }
  size_t plain_start = 0;  // where the current stretch of plain text began
  size_t position = 0;
  while (position < text.size()) {
    const int64_t index = matcher.longest_at(text, position);
    if (index < 0) {
      ++position;
      continue;
    }
    const AddedToken& token = tokens_[index];
    size_t start = position;
    size_t stop = position + (pass == Pass::kRawText ? token.content : token.normalized_content).size();
    if (token.single_word) {
      const bool word_before = start > 0 && is_word_character(last_character(text.substr(0, start)));
      const bool word_after = stop < text.size() && is_word_character(first_character(text.substr(stop)));
      if (word_before || word_after) {
        position = stop;  // tokenizers' matcher resumes after the rejected match too
        continue;
      }
    }
    if (token.lstrip) start = std::max(whitespace_run_start(text, start), plain_start);
    if (token.rstrip) stop = whitespace_run_end(text, stop);
    if (start > plain_start) out.push_back({text.substr(plain_start, start - plain_start), std::nullopt});
    out.push_back({text.substr(start, stop - start), token.id});
    plain_start = position = stop;
  }
  if (plain_start < text.size()) out.push_back({text.substr(plain_start), std::nullopt});
  return out;
}

const AddedToken* AddedVocabulary::find(int64_t id) const {
  auto found = index_of_id_.find(id);
  return found == index_of_id_.end() ? nullptr : &tokens_[found->second];
}

std::optional<int64_t> AddedVocabulary::token_to_id(const std::string& content) const {
  auto found = index_of_content_.find(content);
  if (found == index_of_content_.end()) return std::nullopt;
  return tokens_[found->second].id;
}

}  // namespace qtrain::data
