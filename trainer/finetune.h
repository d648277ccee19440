#pragma once
// The fine-tuning recipe, torchtune-style: setup() builds everything a run needs from a Recipe
// (model, quantized base, LoRA adapters, optimiser, schedule, data), train() runs the loop and
// writes the run directory:
//   RUN/recipe.yaml     the resolved recipe
//   RUN/metrics.jsonl   one JSON object per logged step (and per evaluation)
//   RUN/adapter/        the final PEFT adapter
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/example.h"
#include "data/loader.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "trainer/hf_checkpoint.h"
#include "trainer/peft_adapter.h"
#include "trainer/recipe.h"

namespace qtrain::trainer {

struct TrainSummary {
  int64_t steps = 0;
  double first_eval_loss = 0;  // before the first step (NaN when there is no eval data)
  double last_eval_loss = 0;
  double seconds = 0;
  std::string adapter_dir;
};

class Finetune {
 public:
  explicit Finetune(Recipe recipe);
  void setup();
  TrainSummary train();

 private:
  void setup_model();
  void setup_adapters();
  void setup_optimizer();
  void setup_data();
  // One optimiser step over grad_accum_steps micro-batches; returns the mean token loss.
  double train_step(int64_t step, double& grad_norm, int64_t& tokens);
  double evaluate_and_log(int64_t step);
  void log_metrics(const nlohmann::json& line);
  std::string save_adapter() const;

  Recipe recipe_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType compute_dtype_ = torch::kFloat32;
  LoadedModel loaded_;
  PeftAdapterConfig adapter_config_;
  std::vector<torch::Tensor> trainable_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  optim::LrScheduleOptions schedule_;
  std::unique_ptr<data::DataLoader> train_batches_;
  std::vector<data::Example> eval_examples_;
  int64_t total_steps_ = 0;
  std::string run_dir_;
};

}  // namespace qtrain::trainer
