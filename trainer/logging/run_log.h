#pragma once
// Where a run's metrics go, for the people and tools that read them:
//   RUN/metrics.jsonl        one JSON object per logged line (trainer/logging/metrics_file.h)
//   RUN/tensorboard/         TensorBoard's event files: each metric as a scalar under the tag
//                            of its row in run_log.cpp, the recipe as text (log.tensorboard)
//   RUN/curves.svg           the loss and learning-rate curves, at the end (loss_curves.h)
// A resumed run keeps the lines up to the step it resumes at and drops later ones (logged
// after that checkpoint, before the run stopped); TensorBoard's files are rewritten from the
// kept lines, so no step appears twice anywhere.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace qtrain::trainer {

class TensorBoardWriter;

struct RunLogOptions {
  std::string run_dir;
  bool tensorboard = true;
};

class RunLog {
 public:
  // `resumed_step`: the checkpoint step a resumed run continues from; none for a new run.
  RunLog(RunLogOptions options, std::optional<int64_t> resumed_step);
  ~RunLog();

  // Appends the line (with "time", Unix seconds, added) to metrics.jsonl and TensorBoard.
  void record(nlohmann::json line);
  // A text for TensorBoard's text dashboard (the resolved recipe at the run's first step).
  void text(const std::string& tag, const std::string& text, int64_t step);
  // RUN/curves.svg from metrics.jsonl.
  std::string write_curves() const;

 private:
  void to_tensorboard(const nlohmann::json& line);

  RunLogOptions options_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

// The TensorBoard tag of a metrics.jsonl key ("loss" -> "train/loss"), or "" for keys that are
// not plotted (step, epoch, time ...).
std::string tensorboard_tag(const std::string& metric);

}  // namespace qtrain::trainer
