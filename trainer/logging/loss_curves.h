#pragma once
// The picture of a run: train and eval loss, and the learning rate, against steps, as an SVG
// file that a browser opens (RUN/curves.svg at the end of every run; `qtrain plot` for several
// runs side by side). One polyline point per logged step.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace qtrain::trainer {

struct RunCurves {
  std::string label;  // the run's name in the legend
  std::vector<std::pair<int64_t, double>> train_loss, eval_loss, learning_rate;
};

// The curves of a run's metrics lines (trainer/logging/metrics_file.h); lines without a finite
// value (skipped steps) add no point.
RunCurves run_curves(const std::vector<nlohmann::json>& lines, std::string label);

// The SVG document: a loss panel above a learning-rate panel, one colour per run.
std::string loss_curves_svg(const std::vector<RunCurves>& runs);

// Writes it to `path` atomically; Error naming the path when it cannot.
void write_loss_curves_svg(const std::vector<RunCurves>& runs, const std::string& path);

}  // namespace qtrain::trainer
