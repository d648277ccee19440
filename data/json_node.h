#pragma once
// A JSON value together with where it came from ("tokenizer.json", "model.merges[3]"), so
// that every complaint about a malformed file names the file, the key and what was expected.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace qtrain::data {

class JsonNode {
 public:
  JsonNode(const nlohmann::json& value, std::string file, std::string path = "")
      : value_(&value), file_(std::move(file)), path_(std::move(path)) {}

  // Reads and parses a JSON file; Error naming the file when it is missing or not JSON.
  static nlohmann::json parse_file(const std::string& file);

  const nlohmann::json& value() const { return *value_; }
  const std::string& file() const { return file_; }
  const std::string& path() const { return path_; }
  bool is_null() const { return value_->is_null(); }

  // Throws Error("<file>: <path> <what>").
  [[noreturn]] void fail(const std::string& what) const;

  // A required member of an object (Error when this is not an object or the key is absent).
  JsonNode at(const std::string& key) const;
  // A member that may be absent; an absent or null member gives nullopt.
  std::optional<JsonNode> find(const std::string& key) const;
  // An element of an array.
  JsonNode at(size_t index) const;
  size_t size() const;  // of an array (Error when not an array)

  std::string as_string() const;
  bool as_bool() const;
  int64_t as_integer() const;
  double as_number() const;

  // Optional members with defaults.
  bool bool_or(const std::string& key, bool fallback) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;

 private:
  std::string child_path(const std::string& key) const;
  const nlohmann::json* value_;
  std::string file_;
  std::string path_;
};

}  // namespace qtrain::data
