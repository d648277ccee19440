#include "data/tokenizer_config.h"

#include <filesystem>

#include "data/json_node.h"

namespace qtrain::data {

namespace {

// A special token is written as "<s>" or, by older transformers, as an AddedToken object.
std::optional<std::string> token_name(const JsonNode& config, const std::string& key) {
  auto node = config.find(key);
  if (!node) return std::nullopt;
  if (node->value().is_object()) return node->at("content").as_string();
  return node->as_string();
}

std::optional<std::string> chat_template_of(const JsonNode& config) {
  auto node = config.find("chat_template");
  if (!node) return std::nullopt;
  if (!node->value().is_array()) return node->as_string();
  for (size_t i = 0; i < node->size(); ++i) {
    const JsonNode entry = node->at(i);
    if (entry.at("name").as_string() == "default") return entry.at("template").as_string();
  }
  node->fail("lists chat templates but none is named \"default\"");
}

}  // namespace

TokenizerConfig TokenizerConfig::read(const std::string& path) {
  const nlohmann::json document = JsonNode::parse_file(path);
  const JsonNode root(document, path);
  if (!document.is_object()) root.fail("must be a JSON object");
  TokenizerConfig config;
  config.bos_token = token_name(root, "bos_token");
  config.eos_token = token_name(root, "eos_token");
  config.pad_token = token_name(root, "pad_token");
  config.chat_template = chat_template_of(root);
  return config;
}

TokenizerConfig TokenizerConfig::read_from_model_dir(const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer_config.json";
  if (!std::filesystem::exists(path)) return {};
  return read(path);
}

}  // namespace qtrain::data
