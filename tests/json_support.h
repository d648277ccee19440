#pragma once
// JSON files the suites read: fixtures, and a run's metrics.jsonl.
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace qtrain::testing {

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream input(path);
  return nlohmann::json::parse(input);
}

// RUN/metrics.jsonl, a JSON object per line.
inline std::vector<nlohmann::json> metrics_lines(const std::string& run_dir) {
  std::vector<nlohmann::json> lines;
  std::ifstream file(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(file, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// step -> the number logged under `key`, for the lines that have one.
inline std::map<int64_t, double> logged(const std::vector<nlohmann::json>& lines, const std::string& key) {
  std::map<int64_t, double> values;
  for (const auto& line : lines) {
    if (line.contains(key) && line[key].is_number()) values[line["step"].get<int64_t>()] = line[key].get<double>();
  }
  return values;
}

// The "loss" of every line of RUN/metrics.jsonl that has one, in order.
inline std::vector<double> logged_losses(const std::string& run_dir) {
  std::vector<double> losses;
  for (const auto& line : metrics_lines(run_dir)) {
    if (line.contains("loss")) losses.push_back(line["loss"].get<double>());
  }
  return losses;
}

}  // namespace qtrain::testing
