#pragma once
// config.json read key by key, for parse_hf_config (trainer/formats/hf_config.h) and each family's
// read_config hook (trainer/model/families/).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/error.h"

namespace qtrain::trainer {

// Reads config.json keys with messages that name the file and the key.
class HfConfigReader {
 public:
  HfConfigReader(const nlohmann::json& object, std::string path) : object_(object), path_(std::move(path)) {}

  bool has(const std::string& key) const { return object_.contains(key) && !object_.at(key).is_null(); }
  const nlohmann::json& value(const std::string& key) const { return object_.at(key); }

  int64_t positive_int(const std::string& key) const {
    if (!has(key)) fail("is missing the required key '" + key + "'");
    return positive_int_value(object_.at(key), key);
  }

  int64_t positive_int_or(const std::string& key, int64_t fallback) const {
    return has(key) ? positive_int_value(object_.at(key), key) : fallback;
  }

  double number_or(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    const auto& value = object_.at(key);
    if (!value.is_number()) fail("key '" + key + "' must be a number, got " + value.dump());
    return value.get<double>();
  }

  bool bool_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const auto& value = object_.at(key);
    if (!value.is_boolean()) fail("key '" + key + "' must be true or false, got " + value.dump());
    return value.get<bool>();
  }

  std::string string_or(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const auto& value = object_.at(key);
    if (!value.is_string()) fail("key '" + key + "' must be a string, got " + value.dump());
    return value.get<std::string>();
  }

  std::optional<int64_t> optional_id(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    const auto& value = object_.at(key);
    if (value.is_array() && !value.empty()) return id_value(value.at(0), key);
    return id_value(value, key);
  }

  std::vector<int64_t> id_list(const std::string& key) const {
    if (!has(key)) return {};
    const auto& value = object_.at(key);
    std::vector<int64_t> ids;
    if (value.is_array()) {
      for (const auto& element : value) ids.push_back(id_value(element, key));
    } else {
      ids.push_back(id_value(value, key));
    }
    return ids;
  }

  const nlohmann::json& object() const { return object_; }
  const std::string& path() const { return path_; }

  [[noreturn]] void fail(const std::string& what) const { throw Error(ErrorCode::kModelConfig, path_ + ": " + what); }

 private:
  int64_t positive_int_value(const nlohmann::json& value, const std::string& key) const {
    if (!value.is_number_integer() || value.get<int64_t>() <= 0) {
      fail("key '" + key + "' must be a positive integer, got " + value.dump());
    }
    return value.get<int64_t>();
  }

  int64_t id_value(const nlohmann::json& value, const std::string& key) const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0) {
      fail("key '" + key + "' must be a token id (a non-negative integer), got " + value.dump());
    }
    return value.get<int64_t>();
  }

  const nlohmann::json& object_;
  std::string path_;
};

}  // namespace qtrain::trainer
