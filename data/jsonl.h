#pragma once
// JSON Lines: one JSON object per line; blank lines are skipped. Errors name the file and line.
#include <functional>
#include <istream>
#include <nlohmann/json.hpp>
#include <string>

namespace qtrain::data {

struct JsonlRecord {
  const std::string& source;  // file name (or "<stdin>") for messages
  int64_t line = 0;           // 1-based
  const nlohmann::json& value;  // always an object

  [[noreturn]] void fail(const std::string& what) const;
  // The string field `key`; Error naming source:line when absent or not a string.
  std::string string_field(const std::string& key) const;
};

// A line that is not a JSON object throws Error naming source:line, or, when on_bad_line is
// given, is passed to it (with that message) and skipped.
using BadLineHandler = std::function<void(const std::string& message)>;
void for_each_jsonl_record(std::istream& input, const std::string& source,
                           const std::function<void(const JsonlRecord&)>& visit,
                           const BadLineHandler& on_bad_line = nullptr);
void for_each_jsonl_record(const std::string& path, const std::function<void(const JsonlRecord&)>& visit,
                           const BadLineHandler& on_bad_line = nullptr);

}  // namespace qtrain::data
