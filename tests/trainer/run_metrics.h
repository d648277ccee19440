#pragma once
// What a training run logged: the "loss" of every line of <run>/metrics.jsonl, in order.
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace qtrain::testing {

inline std::vector<double> logged_losses(const std::string& run_dir) {
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  std::vector<double> losses;
  std::string line;
  while (std::getline(metrics, line)) {
    auto value = nlohmann::json::parse(line);
    if (value.contains("loss")) losses.push_back(value["loss"].get<double>());
  }
  return losses;
}

}  // namespace qtrain::testing
