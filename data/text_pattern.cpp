#include "data/text_pattern.h"

namespace qtrain::data {

TextPattern::TextPattern(const JsonNode& pattern) {
  if (auto regex = pattern.find("Regex")) {
    regex_ = std::make_shared<UnicodeRegex>(regex->as_string(), pattern.file() + ": " + regex->path());
  } else if (auto literal = pattern.find("String")) {
    literal_ = literal->as_string();
  } else {
    pattern.fail("must hold a \"Regex\" or a \"String\"");
  }
}

TextPattern TextPattern::regex(const std::string& pattern, const std::string& where) {
  TextPattern compiled;
  compiled.regex_ = std::make_shared<UnicodeRegex>(pattern, where);
  return compiled;
}

TextPattern TextPattern::literal(std::string text) {
  TextPattern pattern;
  pattern.literal_ = std::move(text);
  return pattern;
}

std::vector<TextSpan> TextPattern::find_all(std::string_view text) const {
  if (regex_) return regex_->find_all(text);
  std::vector<TextSpan> matches;
  if (literal_.empty()) return matches;
  for (size_t found = text.find(literal_); found != std::string_view::npos;
       found = text.find(literal_, found + literal_.size())) {
    matches.push_back({found, found + literal_.size()});
  }
  return matches;
}

std::string replace_all(std::string_view text, const TextPattern& pattern, std::string_view content) {
  std::string out;
  out.reserve(text.size());
  size_t previous_end = 0;
  for (const TextSpan& match : pattern.find_all(text)) {
    out.append(text, previous_end, match.begin - previous_end);
    out += content;
    previous_end = match.end;
  }
  out.append(text, previous_end);
  return out;
}

}  // namespace qtrain::data
