#include "data/normalizer.h"

#include "data/text_pattern.h"
#include "data/unicode_normalization.h"

namespace qtrain::data {

namespace {

class NfcStep : public NormalizerStep {
 public:
  void apply(std::string& text) const override { text = normalize_nfc(text); }
};

// As tokenizers' Prepend: an empty stretch stays empty (no lone "▁" between two added tokens).
class PrependStep : public NormalizerStep {
 public:
  explicit PrependStep(const JsonNode& config) : prefix_(config.at("prepend").as_string()) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class ReplaceStep : public NormalizerStep {
 public:
  explicit ReplaceStep(const JsonNode& config)
      : pattern_(config.at("pattern")), content_(config.at("content").as_string()) {}
  void apply(std::string& text) const override { text = replace_all(text, pattern_, content_); }

 private:
  TextPattern pattern_;
  std::string content_;
};

void add_steps(const JsonNode& config, std::vector<std::shared_ptr<const NormalizerStep>>& steps) {
  const JsonNode type_node = config.at("type");
  const std::string type = type_node.as_string();
  if (type == "Sequence") {
    const JsonNode members = config.at("normalizers");
    for (size_t i = 0; i < members.size(); ++i) add_steps(members.at(i), steps);
  } else if (type == "NFC") {
    steps.push_back(std::make_shared<NfcStep>());
  } else if (type == "Prepend") {
    steps.push_back(std::make_shared<PrependStep>(config));
  } else if (type == "Replace") {
    steps.push_back(std::make_shared<ReplaceStep>(config));
  } else {
    type_node.fail("'" + type + "' is not supported (supported normalizers: NFC, Prepend, Replace, a Sequence of "
                   "these, or null)");
  }
}

}  // namespace

Normalizer Normalizer::from_json(const std::optional<JsonNode>& config) {
  Normalizer normalizer;
  if (config) add_steps(*config, normalizer.steps_);
  return normalizer;
}

std::string Normalizer::normalize(std::string_view text) const {
  std::string normalized(text);
  for (const auto& step : steps_) step->apply(normalized);
  return normalized;
}

}  // namespace qtrain::data
