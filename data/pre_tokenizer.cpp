#include "data/pre_tokenizer.h"

#include <algorithm>

#include "data/byte_level.h"
#include "data/unicode_regex.h"

namespace qtrain::data {

namespace {

// GPT-2's pattern, as tokenizers' ByteLevel pre-tokenizer uses it with use_regex = true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// What Split does with the matches of its pattern (tokenizers' SplitDelimiterBehavior).
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior parse_behavior(const JsonNode& node) {
  const std::string name = node.as_string();
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  node.fail("'" + name + "' is not a known split behavior (expected Removed, Isolated, MergedWithPrevious, " +
            "MergedWithNext or Contiguous)");
}

struct Segment {
  TextSpan span;
  bool is_match;
};

// The text cut into matches and the gaps between them, as tokenizers' Pattern::find_matches.
std::vector<Segment> segments_of(std::string_view text, const std::vector<TextSpan>& matches, bool invert) {
  std::vector<Segment> segments;
  size_t previous_end = 0;
  for (const TextSpan& match : matches) {
    if (match.begin > previous_end) segments.push_back({{previous_end, match.begin}, invert});
    segments.push_back({match, !invert});
    previous_end = match.end;
  }
  if (previous_end < text.size()) segments.push_back({{previous_end, text.size()}, invert});
  return segments;
}

// tokenizers' NormalizedString::split: which spans become pieces under each behavior.
std::vector<TextSpan> apply_behavior(const std::vector<Segment>& segments, Behavior behavior) {
  std::vector<TextSpan> spans;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Segment& segment : segments) spans.push_back(segment.span);
      break;
    case Behavior::kRemoved:
      for (const Segment& segment : segments) {
        if (!segment.is_match) spans.push_back(segment.span);
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const Segment& segment : segments) {
        if (segment.is_match && !previous_match && !spans.empty()) {
          spans.back().end = segment.span.end;
        } else {
          spans.push_back(segment.span);
        }
        previous_match = segment.is_match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !spans.empty()) {
          spans.back().begin = it->span.begin;
        } else {
          spans.push_back(it->span);
        }
        previous_match = it->is_match;
      }
      std::reverse(spans.begin(), spans.end());
      break;
    case Behavior::kContiguous:
      for (const Segment& segment : segments) {
        if (segment.is_match == previous_match && !spans.empty()) {
          spans.back().end = segment.span.end;
        } else {
          spans.push_back(segment.span);
        }
        previous_match = segment.is_match;
      }
      break;
  }
  return spans;
}

// Calls split_one on every piece and gathers the non-empty results in order.
template <typename SplitOne>
void split_each(std::vector<std::string>& pieces, const SplitOne& split_one) {
  std::vector<std::string> result;
  result.reserve(pieces.size());
  for (const std::string& piece : pieces) split_one(piece, result);
  pieces = std::move(result);
}

void append_spans(const std::string& piece, const std::vector<TextSpan>& spans, std::vector<std::string>& out) {
  for (const TextSpan& span : spans) {
    if (span.end > span.begin) out.emplace_back(piece, span.begin, span.end - span.begin);
  }
}

std::vector<TextSpan> literal_matches(std::string_view text, const std::string& literal) {
  std::vector<TextSpan> matches;
  if (literal.empty()) return matches;
  for (size_t found = text.find(literal); found != std::string_view::npos;
       found = text.find(literal, found + literal.size())) {
    matches.push_back({found, found + literal.size()});
  }
  return matches;
}

class SplitStep : public PreTokenizerStep {
 public:
  explicit SplitStep(const JsonNode& config) : behavior_(parse_behavior(config.at("behavior"))) {
    invert_ = config.bool_or("invert", false);
    const JsonNode pattern = config.at("pattern");
    if (auto regex = pattern.find("Regex")) {
      regex_ = std::make_shared<UnicodeRegex>(regex->as_string(), pattern.file() + ": " + regex->path());
    } else if (auto literal = pattern.find("String")) {
      literal_ = literal->as_string();
    } else {
      pattern.fail("must hold a \"Regex\" or a \"String\"");
    }
  }

  void apply(std::vector<std::string>& pieces) const override {
    split_each(pieces, [&](const std::string& piece, std::vector<std::string>& out) {
      const auto matches = regex_ ? regex_->find_all(piece) : literal_matches(piece, literal_);
      append_spans(piece, apply_behavior(segments_of(piece, matches, invert_), behavior_), out);
    });
  }

 private:
  Behavior behavior_;
  bool invert_ = false;
  std::shared_ptr<const UnicodeRegex> regex_;
  std::string literal_;
};

// Maps every byte to GPT-2's byte-level alphabet, after an optional leading space and an
// optional split by GPT-2's pattern.
class ByteLevelStep : public PreTokenizerStep {
 public:
  explicit ByteLevelStep(const JsonNode& config) {
    add_prefix_space_ = config.bool_or("add_prefix_space", true);
    if (config.bool_or("use_regex", true)) {
      regex_ = std::make_shared<UnicodeRegex>(kGpt2Pattern, config.file() + ": GPT-2 pattern");
    }
  }

  void apply(std::vector<std::string>& pieces) const override {
    split_each(pieces, [&](const std::string& piece, std::vector<std::string>& out) {
      const std::string text = add_prefix_space_ && piece[0] != ' ' ? " " + piece : piece;
      if (!regex_) {
        out.push_back(byte_level::encode(text));
        return;
      }
      const std::string_view view(text);
      for (const TextSpan& span : apply_behavior(segments_of(view, regex_->find_all(view), false), Behavior::kIsolated)) {
        out.push_back(byte_level::encode(view.substr(span.begin, span.end - span.begin)));
      }
    });
  }

 private:
  bool add_prefix_space_ = true;
  std::shared_ptr<const UnicodeRegex> regex_;
};

// Numbers split off from the rest: each digit alone, or runs of digits.
class DigitsStep : public PreTokenizerStep {
 public:
  explicit DigitsStep(const JsonNode& config)
      : regex_(config.bool_or("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)",
               config.file() + ": " + config.path()) {}

  void apply(std::vector<std::string>& pieces) const override {
    split_each(pieces, [&](const std::string& piece, std::vector<std::string>& out) {
      append_spans(piece, apply_behavior(segments_of(piece, regex_.find_all(piece), false), Behavior::kIsolated),
                   out);
    });
  }

 private:
  UnicodeRegex regex_;
};

void add_steps(const JsonNode& config, std::vector<std::shared_ptr<const PreTokenizerStep>>& steps) {
  const JsonNode type_node = config.at("type");
  const std::string type = type_node.as_string();
  if (type == "Sequence") {
    const JsonNode members = config.at("pretokenizers");
    for (size_t i = 0; i < members.size(); ++i) add_steps(members.at(i), steps);
  } else if (type == "Split") {
    steps.push_back(std::make_shared<SplitStep>(config));
  } else if (type == "ByteLevel") {
    steps.push_back(std::make_shared<ByteLevelStep>(config));
  } else if (type == "Digits") {
    steps.push_back(std::make_shared<DigitsStep>(config));
  } else if (type == "Metaspace") {
    type_node.fail("'Metaspace' is not supported yet: sentencepiece-style tokenizers (Llama 2, Mistral) are not "
                   "implemented; byte-level BPE tokenizers (Llama 3, GPT-2, Qwen) are");
  } else {
    type_node.fail("'" + type + "' is not supported (supported pre-tokenizers: Sequence, Split, ByteLevel, Digits)");
  }
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const std::optional<JsonNode>& config) {
  PreTokenizer pre_tokenizer;
  if (config) add_steps(*config, pre_tokenizer.steps_);
  return pre_tokenizer;
}

std::vector<std::string> PreTokenizer::split(std::string_view text) const {
  std::vector<std::string> pieces;
  if (text.empty()) return pieces;
  pieces.emplace_back(text);
  for (const auto& step : steps_) step->apply(pieces);
  return pieces;
}

}  // namespace qtrain::data
