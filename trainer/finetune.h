#pragma once
// The fine-tuning recipe, torchtune-style: setup() builds everything a run needs from a Recipe
// (model, quantized base, LoRA adapters, optimiser, schedule, data), train() runs the loop and
// writes the run directory:
//   RUN/recipe.yaml     the resolved recipe
//   RUN/metrics.jsonl   one JSON object per logged step (and per evaluation)
//   RUN/tensorboard/    the same metrics as TensorBoard event files (log.tensorboard)
//   RUN/curves.svg      the loss and learning-rate curves (trainer/logging/run_log.h)
//   RUN/adapter/        the final PEFT adapter (runs that train adapters)
//   RUN/export/<format> export.formats besides peft: merged, safetensors-int, gguf (export.out)
//   RUN/checkpoints/    training-state checkpoints (trainer/formats/training_checkpoint.h)
//
// Under a launcher (trainer/dist/launch_environment.h) every rank runs this same recipe on its own
// slice of each global batch; gradients are summed over the ranks during backward
// (trainer/dist/gradient_buckets.h). Rank 0 alone writes the run directory; the others wait for it.
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/example.h"
#include "data/loader.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "trainer/dist/gradient_buckets.h"
#include "trainer/formats/base_directory.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/dist/launch_environment.h"
#include "trainer/logging/progress_line.h"
#include "trainer/logging/run_log.h"
#include "trainer/loss_scaler.h"
#include "trainer/objectives/preference_eval.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/dist/process_group.h"
#include "trainer/recipe/recipe.h"
#include "trainer/training_step.h"

namespace qtrain::trainer {

struct TrainSummary {
  int64_t steps = 0;
  double first_eval_loss = 0;  // before the first step (NaN when there is no eval data)
  double last_eval_loss = 0;
  double seconds = 0;
  std::string adapter_dir;           // RUN/adapter; empty when the run trained the full weights
  std::vector<std::string> exports;  // export.formats other than peft, under export.out
  bool stopped = false;        // a stop signal ended the run early (trainer/stop_signal.h)
  std::string checkpoint_dir;  // the last checkpoint written
};

class Finetune {
 public:
  // resume: "" starts fresh; "auto" continues from the newest valid checkpoint of the run
  // directory (fresh when there is none, and says so); a path continues from that checkpoint.
  explicit Finetune(Recipe recipe, std::string resume = "");
  void setup();
  TrainSummary train();

  // The training step's seam (trainer/training_step.h): after each step's backward.
  void set_after_backward(AfterBackward hook) { after_backward_ = std::move(hook); }
  // Redraws a progress line on the terminal after each step (trainer/logging/progress_line.h);
  // off by default, as for output to a file.
  void set_progress_line(bool enabled) { progress_ = ProgressLine(enabled && launch_.rank == 0); }

 private:
  void setup_model();
  void setup_adapters();
  void setup_optimizer();
  void setup_data();
  // One optimiser step over grad_accum_steps micro-batches (trainer/training_step.h), at the
  // schedule's learning rate.
  StepResult train_step(int64_t step);
  void handle_skipped_step(int64_t step, const StepResult& result, bool scale_overflow);
  double evaluate_and_log(int64_t step);
  // A preference objective's evaluation: its loss and metrics over the eval pairs, as eval_*.
  double evaluate_pairs_and_log(int64_t step);
  // dpo.precompute_reference (and full-weight DPO): the reference's log-probabilities of every
  // pair, computed once before training from the model as loaded (`what` names the split).
  void precompute_reference(std::vector<data::Example>& examples, const std::string& what);
  // Batches of pairs outside the step (evaluation, the reference pass), as the step runs them.
  PairPassOptions pair_pass_options() const;
  void log_metrics(const nlohmann::json& line);
  // A line of the run's output (above the progress line, when there is one).
  void print_line(const std::string& line);
  // Ends the progress line and writes RUN/curves.svg.
  void write_curves();
  std::string save_adapter();
  std::vector<std::string> write_exports();
  std::string save_checkpoint(int64_t steps_done);
  // Whether a stop signal reached any rank (all ranks must stop after the same step).
  bool any_rank_stopping();
  bool writes_files() const { return launch_.rank == 0; }
  // Every rank has got here (no-op on one process).
  void wait_for_all_ranks(const std::string& what);
  // Loads the checkpoint `resume_` names, if any; returns whether the run continues one.
  bool resume_if_asked();

  Recipe recipe_;
  LaunchEnvironment launch_;
  std::unique_ptr<ProcessGroup> group_;  // only with more than one rank
  std::unique_ptr<GradientBuckets> gradient_buckets_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType compute_dtype_ = torch::kFloat32;
  LoadedModel loaded_;
  // What the exports take from the base directory, read once before training when export.formats
  // names any (the pre-flight checks it then, the exports at the end write from it).
  BaseDirectory export_base_;
  PeftAdapterConfig adapter_config_;
  std::vector<torch::Tensor> trainable_;
  std::vector<std::string> trainable_names_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  optim::LrScheduleOptions schedule_;
  std::unique_ptr<data::DataLoader> train_batches_;
  std::vector<data::Example> eval_examples_;  // this rank's share of the eval split
  bool has_eval_data_ = false;
  std::optional<PreferenceOptions> preference_;  // train.objective dpo, orpo or simpo
  int64_t total_steps_ = 0;
  LossScaler scaler_{false};
  TrainingStepOptions step_options_;
  std::unique_ptr<TrainingStep> step_;
  int64_t pad_id_ = 0;
  int64_t optimizer_steps_ = 0;  // steps applied (skipped ones are not)
  int64_t skipped_steps_ = 0;
  int64_t consecutive_skips_ = 0;
  AfterBackward after_backward_;
  std::string resume_;
  int64_t first_step_ = 0;  // steps already done by the checkpoint resumed from
  std::string run_dir_;
  std::unique_ptr<RunLog> run_log_;  // rank 0's
  ProgressLine progress_;
};

}  // namespace qtrain::trainer
