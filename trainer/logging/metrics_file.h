#pragma once
// RUN/metrics.jsonl: one JSON object per logged line of a run, in order. Training lines hold
// "step", "loss", "lr", "grad_norm", "tokens_per_second", memory and "time" (Unix seconds);
// evaluation lines "step" and "eval_loss"; skipped steps "skipped": true.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace qtrain::trainer {

// The lines of a metrics file's text; `source` names it in errors (Error naming source:line
// when a line is not a JSON object with an integer "step").
std::vector<nlohmann::json> parse_metrics_lines(const std::string& text, const std::string& source);
// The lines of the file (RUN/metrics.jsonl, or a run directory holding one).
std::vector<nlohmann::json> read_metrics_file(const std::string& path);

// A number of a line, or NaN where the key is absent or not a number (null: a non-finite value).
double metric_value(const nlohmann::json& line, const char* key);

}  // namespace qtrain::trainer
