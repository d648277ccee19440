#include "data/pre_tokenizer.h"

#include <algorithm>

#include "data/byte_level.h"
#include "data/text_pattern.h"
#include "data/unicode_regex.h"
#include "data/utf8.h"

namespace qtrain::data {

namespace {

// GPT-2's pattern, as tokenizers' ByteLevel pre-tokenizer uses it with use_regex = true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The character classes of tokenizers' fixed splits, for PCRE2 with UCP. Whitespace is Rust's
// char::is_whitespace (Unicode White_Space), which also is Oniguruma's \s.
constexpr const char* kWhitespaceCharacters = R"(\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
// Oniguruma's Unicode \w, as tokenizers' Whitespace pattern uses it: alphabetic characters
// (letters, letter numbers such as U+2167, circled letters), marks, decimal digits, connector
// punctuation ("_"), and the joiners U+200C, U+200D; not other numbers such as "²" or "½".
constexpr const char* kWordCharacters = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D})";
// tokenizers' is_punc: Unicode punctuation (P*) or ASCII punctuation, which takes in the ASCII
// symbols $ + < = > ^ ` | ~.
constexpr const char* kPunctuationCharacters = R"(\p{P}!-\/:-@\[-`{-~)";

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

// Replaces every piece by what split_one(piece, starts_input, out) appends to out (non-empty
// pieces); split_one returns whether the first piece it appended begins where its piece began.
template <typename SplitOne>
void split_each(PreTokenizedText& text, const SplitOne& split_one) {
  std::vector<std::string> result;
  result.reserve(text.pieces.size());
  bool first_piece_starts_input = false;
  for (size_t i = 0; i < text.pieces.size(); ++i) {
    const bool starts_input = i == 0 && text.first_piece_starts_input;
    const bool first_kept_at_start = split_one(text.pieces[i], starts_input, result);
    if (i == 0) first_piece_starts_input = starts_input && first_kept_at_start && !result.empty();
  }
  text.pieces = std::move(result);
  text.first_piece_starts_input = first_piece_starts_input;
}

// Appends the non-empty spans of piece; whether the first of them begins at 0.
bool append_spans(std::string_view piece, const std::vector<TextSpan>& spans, std::vector<std::string>& out) {
  bool first_at_start = false;
  bool first = true;
  for (const TextSpan& span : spans) {
    if (span.end <= span.begin) continue;
    if (first) first_at_start = span.begin == 0;
    first = false;
    out.emplace_back(piece.substr(span.begin, span.end - span.begin));
  }
  return first_at_start;
}

class SplitPreTokenization : public PreTokenizerStep {
 public:
  SplitPreTokenization(TextPattern pattern, Behavior behavior, bool invert = false)
      : behavior_(behavior), pattern_(std::move(pattern)), invert_(invert) {}
  static std::shared_ptr<SplitPreTokenization> from_json(const JsonNode& config) {
    return std::make_shared<SplitPreTokenization>(TextPattern(config.at("pattern")), parse_behavior(config.at("behavior")),
                                       config.bool_or("invert", false));
  }

  void apply(PreTokenizedText& text) const override {
    split_each(text, [&](const std::string& piece, bool, std::vector<std::string>& out) {
      return append_spans(piece, apply_behavior(segments_of(piece, pattern_.find_all(piece), invert_), behavior_), out);
    });
  }

 private:
  Behavior behavior_;
  TextPattern pattern_;
  bool invert_;
};

// Maps every byte to GPT-2's byte-level alphabet, after an optional leading space and an
// optional split by GPT-2's pattern.
class ByteLevelPreTokenization : public PreTokenizerStep {
 public:
  explicit ByteLevelPreTokenization(const JsonNode& config) {
    add_prefix_space_ = config.bool_or("add_prefix_space", true);
    if (config.bool_or("use_regex", true)) {
      regex_ = std::make_shared<UnicodeRegex>(kGpt2Pattern, config.file() + ": GPT-2 pattern");
    }
  }

  void apply(PreTokenizedText& text) const override {
    split_each(text, [&](const std::string& piece, bool, std::vector<std::string>& out) {
      const std::string prefixed = add_prefix_space_ && piece[0] != ' ' ? " " + piece : piece;
      if (!regex_) {
        out.push_back(byte_level::encode(prefixed));
        return true;
      }
      // Isolated keeps every segment, so the first piece begins at the start.
      const std::string_view view(prefixed);
      for (const TextSpan& span : apply_behavior(segments_of(view, regex_->find_all(view), false), Behavior::kIsolated)) {
        out.push_back(byte_level::encode(view.substr(span.begin, span.end - span.begin)));
      }
      return true;
    });
  }

 private:
  bool add_prefix_space_ = true;
  std::shared_ptr<const UnicodeRegex> regex_;
};

// Numbers split off from the rest: each digit alone, or runs of digits.
class DigitsPreTokenization : public PreTokenizerStep {
 public:
  explicit DigitsPreTokenization(const JsonNode& config)
      : regex_(config.bool_or("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)",
               config.file() + ": " + config.path()) {}

  void apply(PreTokenizedText& text) const override {
    split_each(text, [&](const std::string& piece, bool, std::vector<std::string>& out) {
      return append_spans(piece, apply_behavior(segments_of(piece, regex_.find_all(piece), false), Behavior::kIsolated),
                          out);
    });
  }

 private:
  UnicodeRegex regex_;
};

// Sentencepiece's view of whitespace: every space becomes the replacement character "▁", a
// "▁" goes in front as the prepend scheme says, and with split each "▁" begins a new piece.
class MetaspacePreTokenization : public PreTokenizerStep {
 public:
  explicit MetaspacePreTokenization(const JsonNode& config)
      : options_(MetaspaceOptions::from_json(config)),
        space_(TextPattern::literal(" ")),
        replacement_(TextPattern::literal(options_.replacement)) {}

  void apply(PreTokenizedText& text) const override {
    split_each(text, [&](const std::string& piece, bool starts_input, std::vector<std::string>& out) {
      std::string replaced = replace_all(piece, space_, options_.replacement);
      const bool prepend = options_.prepend_scheme == PrependScheme::kAlways ||
                           (options_.prepend_scheme == PrependScheme::kFirst && starts_input);
      if (prepend && replaced.compare(0, options_.replacement.size(), options_.replacement) != 0) {
        replaced.insert(0, options_.replacement);
      }
      if (!options_.split) {
        out.push_back(std::move(replaced));
        return true;
      }
      const auto matches = replacement_.find_all(replaced);
      return append_spans(replaced, apply_behavior(segments_of(replaced, matches, false), Behavior::kMergedWithNext),
                          out);
    });
  }

 private:
  MetaspaceOptions options_;
  TextPattern space_;
  TextPattern replacement_;
};

// tokenizers' pre-tokenizers that are a Split by a fixed pattern, each matching character on
// its own (a char-predicate pattern in tokenizers: "..." is three matches).
void add_fixed_split_steps(const JsonNode& config, const std::string& type,
                           std::vector<std::shared_ptr<const PreTokenizerStep>>& steps) {
  const std::string where = config.file() + ": " + config.path() + " (" + type + ")";
  auto one_of = [&](const std::string& characters) { return TextPattern::regex("[" + characters + "]", where); };
  if (type == "Punctuation") {  // Falcon's
    const std::optional<JsonNode> behavior = config.find("behavior");
    steps.push_back(std::make_shared<SplitPreTokenization>(one_of(kPunctuationCharacters),
                                                behavior ? parse_behavior(*behavior) : Behavior::kIsolated));
  } else if (type == "Whitespace") {
    // Keeps the matches of \w+|[^\w\s]+: runs of word characters, runs of other non-spaces.
    const std::string words = kWordCharacters;
    steps.push_back(std::make_shared<SplitPreTokenization>(
        TextPattern::regex("[" + words + "]+|[^" + words + kWhitespaceCharacters + "]+", where), Behavior::kRemoved,
        /*invert=*/true));
  } else if (type == "WhitespaceSplit") {
    steps.push_back(std::make_shared<SplitPreTokenization>(one_of(kWhitespaceCharacters), Behavior::kRemoved));
  } else if (type == "BertPreTokenizer") {
    steps.push_back(std::make_shared<SplitPreTokenization>(one_of(kWhitespaceCharacters), Behavior::kRemoved));
    steps.push_back(std::make_shared<SplitPreTokenization>(one_of(kPunctuationCharacters), Behavior::kIsolated));
  } else {  // CharDelimiterSplit
    const JsonNode delimiter = config.at("delimiter");
    const std::string character = delimiter.as_string();
    if (character.empty() || utf8::character_at(character, 0).length != character.size()) {
      delimiter.fail("must be one character, got '" + character + "'");
    }
    steps.push_back(std::make_shared<SplitPreTokenization>(TextPattern::literal(character), Behavior::kRemoved));
  }
}

void add_pre_tokenizer_steps(const JsonNode& config, std::vector<std::shared_ptr<const PreTokenizerStep>>& steps) {
  const JsonNode type_node = config.at("type");
  const std::string type = type_node.as_string();
  if (type == "Sequence") {
    const JsonNode members = config.at("pretokenizers");
    for (size_t i = 0; i < members.size(); ++i) add_pre_tokenizer_steps(members.at(i), steps);
  } else if (type == "Split") {
    steps.push_back(SplitPreTokenization::from_json(config));
  } else if (type == "Punctuation" || type == "Whitespace" || type == "WhitespaceSplit" || type == "BertPreTokenizer" ||
             type == "CharDelimiterSplit") {
    add_fixed_split_steps(config, type, steps);
  } else if (type == "ByteLevel") {
    steps.push_back(std::make_shared<ByteLevelPreTokenization>(config));
  } else if (type == "Digits") {
    steps.push_back(std::make_shared<DigitsPreTokenization>(config));
  } else if (type == "Metaspace") {
    steps.push_back(std::make_shared<MetaspacePreTokenization>(config));
  } else if (type == "UnicodeScripts") {
    type_node.fail("'UnicodeScripts' is not supported (it cuts where the Unicode script changes; no released "
                   "model's tokenizer.json uses it)");
  } else if (type == "FixedLength") {
    type_node.fail("'FixedLength' is not supported (it cuts text into pieces of a fixed number of characters, "
                   "for DNA and protein models, not language models)");
  } else {
    type_node.fail("'" + type + "' is not supported (supported pre-tokenizers: Sequence, Split, ByteLevel, Digits, "
                   "Metaspace, Punctuation, Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit)");
  }
}

}  // namespace

MetaspaceOptions MetaspaceOptions::from_json(const JsonNode& config) {
  MetaspaceOptions options;
  const JsonNode replacement = config.at("replacement");
  options.replacement = replacement.as_string();
  if (options.replacement.empty() || utf8::character_at(options.replacement, 0).length != options.replacement.size()) {
    replacement.fail("must be one character, got '" + options.replacement + "'");
  }
  if (auto scheme = config.find("prepend_scheme")) {
    const std::string name = scheme->as_string();
    if (name == "always") {
      options.prepend_scheme = PrependScheme::kAlways;
    } else if (name == "first") {
      options.prepend_scheme = PrependScheme::kFirst;
    } else if (name == "never") {
      options.prepend_scheme = PrependScheme::kNever;
    } else {
      scheme->fail("'" + name + "' is not a prepend scheme (expected always, first or never)");
    }
  }
  // Files written before prepend_scheme existed say add_prefix_space instead.
  if (auto add_prefix_space = config.find("add_prefix_space"); add_prefix_space && !add_prefix_space->as_bool()) {
    if (options.prepend_scheme != PrependScheme::kNever) {
      add_prefix_space->fail("false contradicts prepend_scheme (tokenizers refuses this file too; set prepend_scheme "
                             "to \"never\")");
    }
  }
  options.split = config.bool_or("split", true);
  return options;
}

PreTokenizer PreTokenizer::from_json(const std::optional<JsonNode>& config) {
  PreTokenizer pre_tokenizer;
  if (config) add_pre_tokenizer_steps(*config, pre_tokenizer.steps_);
  return pre_tokenizer;
}

std::vector<std::string> PreTokenizer::split(std::string_view text, bool starts_input) const {
  PreTokenizedText pre_tokenized;
  if (text.empty()) return pre_tokenized.pieces;
  pre_tokenized.pieces.emplace_back(text);
  pre_tokenized.first_piece_starts_input = starts_input;
  for (const auto& step : steps_) step->apply(pre_tokenized);
  return std::move(pre_tokenized.pieces);
}

}  // namespace qtrain::data
