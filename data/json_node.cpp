#include "data/json_node.h"

#include "data/text_file.h"
#include "kernels/error.h"

namespace qtrain::data {

nlohmann::json JsonNode::parse_file(const std::string& file) {
  auto value = nlohmann::json::parse(read_text_file(file, "a JSON file"), nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) throw Error(ErrorCode::kTokenizer, file + ": not valid JSON (is the file complete?)");
  return value;
}

void JsonNode::fail(const std::string& what) const {
  throw Error(ErrorCode::kTokenizer, file_ + ": " + (path_.empty() ? "the top level" : path_) + " " + what);
}

std::string JsonNode::child_path(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

JsonNode JsonNode::at(const std::string& key) const {
  if (!value_->is_object()) fail("must be a JSON object, got " + std::string(value_->type_name()));
  auto found = value_->find(key);
  if (found == value_->end()) throw Error(ErrorCode::kTokenizer, file_ + ": missing the key '" + child_path(key) + "'");
  return JsonNode(*found, file_, child_path(key));
}

std::optional<JsonNode> JsonNode::find(const std::string& key) const {
  if (!value_->is_object()) fail("must be a JSON object, got " + std::string(value_->type_name()));
  auto found = value_->find(key);
  if (found == value_->end() || found->is_null()) return std::nullopt;
  return JsonNode(*found, file_, child_path(key));
}

JsonNode JsonNode::at(size_t index) const {
  if (!value_->is_array()) fail("must be a JSON array, got " + std::string(value_->type_name()));
  if (index >= value_->size()) fail("has no element " + std::to_string(index));
  return JsonNode((*value_)[index], file_, path_ + "[" + std::to_string(index) + "]");
}

size_t JsonNode::size() const {
  if (!value_->is_array()) fail("must be a JSON array, got " + std::string(value_->type_name()));
  return value_->size();
}

std::string JsonNode::as_string() const {
  if (!value_->is_string()) fail("must be a string, got " + std::string(value_->type_name()));
  return value_->get<std::string>();
}

bool JsonNode::as_bool() const {
  if (!value_->is_boolean()) fail("must be true or false, got " + std::string(value_->type_name()));
  return value_->get<bool>();
}

int64_t JsonNode::as_integer() const {
  if (!value_->is_number_integer()) fail("must be an integer, got " + std::string(value_->type_name()));
  return value_->get<int64_t>();
}

double JsonNode::as_number() const {
  if (!value_->is_number()) fail("must be a number, got " + std::string(value_->type_name()));
  return value_->get<double>();
}

bool JsonNode::bool_or(const std::string& key, bool fallback) const {
  auto member = find(key);
  return member ? member->as_bool() : fallback;
}

std::string JsonNode::string_or(const std::string& key, const std::string& fallback) const {
  auto member = find(key);
  return member ? member->as_string() : fallback;
}

}  // namespace qtrain::data
