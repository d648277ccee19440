#include "data/jsonl.h"

#include <fstream>

#include "kernels/error.h"

namespace qtrain::data {

void JsonlRecord::fail(const std::string& what) const {
  throw Error(ErrorCode::kData, source + ":" + std::to_string(line) + ": " + what);
}

std::string JsonlRecord::string_field(const std::string& key) const {
  auto found = value.find(key);
  if (found == value.end()) fail("missing the field \"" + key + "\"");
  if (!found->is_string()) fail("field \"" + key + "\" must be a string");
  return found->get<std::string>();
}

void for_each_jsonl_record(std::istream& input, const std::string& source,
                           const std::function<void(const JsonlRecord&)>& visit, const BadLineHandler& on_bad_line) {
  std::string text;
  int64_t line = 0;
  while (std::getline(input, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    std::string problem;
    if (value.is_discarded()) {
      problem = "not valid JSON";
    } else if (!value.is_object()) {
      problem = "expected a JSON object per line, got " + std::string(value.type_name());
    }
    if (problem.empty()) {
      visit(JsonlRecord{source, line, value});
    } else if (on_bad_line) {
      on_bad_line(source + ":" + std::to_string(line) + ": " + problem);
    } else {
      throw Error(ErrorCode::kData, source + ":" + std::to_string(line) + ": " + problem);
    }
  }
  if (input.bad()) throw Error(ErrorCode::kData, source + ": read error after line " + std::to_string(line));
}

void for_each_jsonl_record(const std::string& path, const std::function<void(const JsonlRecord&)>& visit,
                           const BadLineHandler& on_bad_line) {
  std::ifstream input(path);
  if (!input) throw Error(ErrorCode::kData, path + ": cannot open (expected a JSONL file)");
  for_each_jsonl_record(input, path, visit, on_bad_line);
}

}  // namespace qtrain::data
