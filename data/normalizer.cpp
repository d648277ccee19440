#include "data/normalizer.h"

#include "data/byte_level.h"
#include "data/text_pattern.h"
#include "data/unicode_normalization.h"
#include "data/utf8.h"

namespace qtrain::data {

namespace {

class NfcNormalization : public NormalizerStep {
 public:
  void apply(std::string& text) const override { text = normalize_nfc(text); }
};

class NfdNormalization : public NormalizerStep {
 public:
  void apply(std::string& text) const override { text = normalize_nfd(text); }
};

// Drops every mark (Mn, Mc, Me) as tokenizers' StripAccents does; files put NFD before it so
// that "é" is "e" + U+0301 by then.
class StripAccentsNormalization : public NormalizerStep {
 public:
  explicit StripAccentsNormalization(const JsonNode& config)
      : marks_(TextPattern::regex(R"(\p{M}+)", config.file() + ": " + config.path() + " (StripAccents)")) {}
  void apply(std::string& text) const override { text = replace_all(text, marks_, ""); }

 private:
  TextPattern marks_;
};

// Whitespace (Rust's char::is_whitespace) off the start and/or the end.
class StripNormalization : public NormalizerStep {
 public:
  explicit StripNormalization(const JsonNode& config)
      : strip_left_(config.bool_or("strip_left", true)), strip_right_(config.bool_or("strip_right", true)) {}
  void apply(std::string& text) const override {
    size_t end = text.size();
    while (strip_right_ && end > 0) {
      const size_t start = utf8::start_of_character_before(text, end);
      if (!utf8::is_whitespace(utf8::character_at(text, start).code_point)) break;
      end = start;
    }
    size_t begin = 0;
    while (strip_left_ && begin < end) {
      const utf8::Character character = utf8::character_at(text, begin);
      if (!utf8::is_whitespace(character.code_point)) break;
      begin += character.length;
    }
    text = text.substr(begin, end - begin);
  }

 private:
  bool strip_left_;
  bool strip_right_;
};

// Every byte as its character of GPT-2's byte-level alphabet, as the ByteLevel pre-tokenizer
// maps it.
class ByteLevelNormalization : public NormalizerStep {
 public:
  void apply(std::string& text) const override { text = byte_level::encode(text); }
};

// As tokenizers' Prepend: an empty stretch stays empty (no lone "▁" between two added tokens).
class PrependNormalization : public NormalizerStep {
 public:
  explicit PrependNormalization(const JsonNode& config) : prefix_(config.at("prepend").as_string()) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class ReplaceNormalization : public NormalizerStep {
 public:
  explicit ReplaceNormalization(const JsonNode& config)
      : pattern_(config.at("pattern")), content_(config.at("content").as_string()) {}
  void apply(std::string& text) const override { text = replace_all(text, pattern_, content_); }

 private:
  TextPattern pattern_;
  std::string content_;
};

using NormalizerRow = std::pair<const char*, std::shared_ptr<const NormalizerStep> (*)(const JsonNode& config)>;

// The normalizers qtrain implements, by tokenizer.json's type name.
const std::vector<NormalizerRow>& normalizer_rows() {
  static const std::vector<NormalizerRow> rows = {
      {"NFC", [](const JsonNode&) -> std::shared_ptr<const NormalizerStep> { return std::make_shared<NfcNormalization>(); }},
      {"NFD", [](const JsonNode&) -> std::shared_ptr<const NormalizerStep> { return std::make_shared<NfdNormalization>(); }},
      {"StripAccents", [](const JsonNode& config) -> std::shared_ptr<const NormalizerStep> {
         return std::make_shared<StripAccentsNormalization>(config);
       }},
      {"Strip", [](const JsonNode& config) -> std::shared_ptr<const NormalizerStep> { return std::make_shared<StripNormalization>(config); }},
      {"Prepend", [](const JsonNode& config) -> std::shared_ptr<const NormalizerStep> {
         return std::make_shared<PrependNormalization>(config);
       }},
      {"Replace", [](const JsonNode& config) -> std::shared_ptr<const NormalizerStep> {
         return std::make_shared<ReplaceNormalization>(config);
       }},
      {"ByteLevel", [](const JsonNode&) -> std::shared_ptr<const NormalizerStep> { return std::make_shared<ByteLevelNormalization>(); }},
  };
  return rows;
}

void add_normalizer_steps(const JsonNode& config, std::vector<std::shared_ptr<const NormalizerStep>>& steps) {
  static const std::string kSupported =
      "supported normalizers: NFC, NFD, StripAccents, Strip, Prepend, Replace, ByteLevel, a Sequence of these, or null";
  const JsonNode type_node = config.at("type");
  const std::string type = type_node.as_string();
  if (type == "Sequence") {
    const JsonNode members = config.at("normalizers");
    for (size_t i = 0; i < members.size(); ++i) add_normalizer_steps(members.at(i), steps);
    return;
  }
  for (const auto& [name, make] : normalizer_rows()) {
    if (type == name) {
      steps.push_back(make(config));
      return;
    }
  }
  if (type == "BertNormalizer" || type == "Nmt" || type == "Precompiled") {
    type_node.fail("'" + type + "' is not supported (it comes with " +
                   (type == "BertNormalizer" ? "BERT's WordPiece models" : "sentencepiece Unigram models (T5, ALBERT)") +
                   ", and qtrain reads BPE models only)");
  }
  if (type == "Lowercase" || type == "NFKC" || type == "NFKD") {
    type_node.fail("'" + type + "' is not supported yet (it needs Unicode " + (type == "Lowercase" ? "case" : "compatibility") +
                   " tables that qtrain does not carry; " + kSupported + ")");
  }
  type_node.fail("'" + type + "' is not supported (" + kSupported + ")");
}

}  // namespace

Normalizer Normalizer::from_json(const std::optional<JsonNode>& config) {
  Normalizer normalizer;
  if (config) add_normalizer_steps(*config, normalizer.steps_);
  return normalizer;
}

std::string Normalizer::normalize(std::string_view text) const {
  std::string normalized(text);
  for (const auto& step : steps_) step->apply(normalized);
  return normalized;
}

}  // namespace qtrain::data
