#include "trainer/logging/metrics_file.h"

#include <fstream>
#include <limits>
#include <sstream>

#include "kernels/error.h"
#include "trainer/base/file_system.h"

namespace qtrain::trainer {

std::vector<nlohmann::json> parse_metrics_lines(const std::string& text, const std::string& source) {
  std::vector<nlohmann::json> lines;
  std::istringstream stream(text);
  std::string line;
  int64_t number = 0;
  while (std::getline(stream, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto value = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!value.is_object() || !value.contains("step") || !value["step"].is_number_integer()) {
      throw Error(ErrorCode::kData, source + ":" + std::to_string(number) +
                                        ": expected one JSON object with an integer \"step\" per line, as qtrain writes "
                                        "metrics.jsonl; got: " + line.substr(0, 80));
    }
    lines.push_back(std::move(value));
  }
  return lines;
}

std::vector<nlohmann::json> read_metrics_file(const std::string& path) {
  const std::string file = is_regular_file(path) ? path : path + "/metrics.jsonl";
  std::ifstream stream(file, std::ios::binary);
  if (!stream) {
    throw Error(ErrorCode::kFileSystem, file + ": cannot read the run's metrics (give a run directory, as train.output_dir, or its metrics.jsonl)");
  }
  std::ostringstream text;
  text << stream.rdbuf();
  return parse_metrics_lines(text.str(), file);
}

double metric_value(const nlohmann::json& line, const char* key) {
  const auto found = line.find(key);
  if (found == line.end() || !found->is_number()) return std::numeric_limits<double>::quiet_NaN();
  return found->get<double>();
}

}  // namespace qtrain::trainer
