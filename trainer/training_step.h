#pragma once
// One optimizer step over a window of micro-batches: the arithmetic a run takes (Finetune) and
// the one `qtrain bench` times, so that the benchmark measures the code users run.
//   forward, chunked (or fused) loss, backward of the loss scaled by (loss scale / predicted
//   tokens of the window), gradients summed over the ranks during the window's last backward,
//   unscale and check, clip, optimizer step — or, on a non-finite loss or gradient, no update.
// What a run adds around it (the learning-rate schedule, the data position, QAT's start step,
// counting and logging skipped steps) stays in Finetune.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/batching.h"
#include "optim/optimizer.h"
#include "trainer/base/memory_stats.h"
#include "trainer/dist/gradient_buckets.h"
#include "trainer/dist/process_group.h"
#include "trainer/loss_scaler.h"
#include "trainer/model/attention_mask.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/llama.h"
#include "trainer/objectives/preference_loss.h"
#include "trainer/deferred_update.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

// What one optimizer step did.
struct StepResult {
  // sft: the mean over the learned tokens of the accumulation window; a preference objective: the
  // mean of its micro-batches' losses (over the ranks too), as TRL averages them
  double loss = 0;
  double grad_norm = 0;
  int64_t tokens = 0;
  bool skipped = false;  // a non-finite loss or gradient: no update
  std::string skip_reason;
  int64_t epoch = 0;  // where in the data the step's batches began
  int64_t batch_in_epoch = 0;
  // A preference objective's metrics (TRL's names), means over the window's micro-batches.
  std::vector<std::pair<std::string, double>> metrics;
};

struct TrainingStepOptions {
  torch::Device device{torch::kCPU};  // the model's
  int64_t loss_chunk_tokens = 0;      // causal_lm_loss's chunk
  bool fused_loss = true;             // causal_lm_loss over vocabulary tiles (where lm_head is frozen)
  double max_grad_norm = 1.0;     // <= 0: no clipping (the norm is still measured)
  // Packed batches: flash attention over the samples' spans where it applies; `qtrain bench
  // --packed-mask` writes the block-causal mask out instead, to compare.
  PackedAttention packed_attention = PackedAttention::kSpans;
  bool optimizer_states_on_host = false;  // train.optimizer_states_on_host (trainer/deferred_update.h)
  // train.objective dpo, orpo or simpo: micro-batches of pairs (trainer/objectives/); none: sft.
  std::optional<PreferenceOptions> preference;

  // causal_lm_loss's chunk and path, as every pass of the run takes them (the gradient undeclared).
  LossOptions loss_options() const;
};

// train.loss_chunk_tokens (sized from the vocabulary when 0), train.fused_loss, train.max_grad_norm,
// train.optimizer_states_on_host, train.objective and the dpo section.
TrainingStepOptions training_step_options(const Recipe& recipe, int64_t vocab_size, const torch::Device& device);

// train.objective and the dpo section; none for sft.
std::optional<PreferenceOptions> preference_options(const Recipe& recipe);

// Called after the window's backward, before the gradients are checked and applied: a seam
// for tests (inject a NaN) and for tools that look at gradients.
using AfterBackward = std::function<void(int64_t step, const std::vector<torch::Tensor>& trainable)>;

class TrainingStep {
 public:
  // Holds references: the model, optimizer and scaler outlive the step.
  TrainingStep(LlamaForCausalLMImpl& model, std::vector<torch::Tensor> trainable, optim::Optimizer& optimizer,
               LossScaler& scaler, TrainingStepOptions options);
  ~TrainingStep();
  TrainingStep(const TrainingStep&) = delete;
  TrainingStep& operator=(const TrainingStep&) = delete;

  // More than one rank: `group` sums the token counts and the loss, `buckets` the gradients.
  void set_ranks(ProcessGroup* group, GradientBuckets* buckets);

  // Batches on the CPU (as the data loader hands them out); they move to the model's device here.
  // A skipped step has cleared the gradients and backed the loss scale off.
  StepResult run(const std::vector<data::Batch>& micro_batches, int64_t step, const AfterBackward& after_backward = {});

  // Before the host reads the trained weights or the optimizer's state (a checkpoint, an export,
  // the end of a run): with train.optimizer_states_on_host, the update that waits for the next
  // forward is applied and the state's copies to the host are done. The state stays on the host.
  void settle_optimizer_state();
  // bench --memory-phases: the steps mark their phases there (forward, loss, backward, update;
  // the caller finishes the last); nullptr: none.
  void set_memory_phases(MemoryPhases* phases) { phases_ = phases; }

 private:
  // Checks the window's gradients and applies them (or skips the step); `result` holds its loss.
  StepResult apply_gradients(StepResult result, int64_t step, const AfterBackward& after_backward);
  // One micro-batch's forward pass: the tensor its backward starts from, and what it adds to the
  // step's loss sum (read after the backward, so that reading it waits for nothing new).
  struct MicroBatchLoss {
    torch::Tensor backward_from;
    std::function<double()> loss_sum;
  };
  // The window's micro-batches, forward then backward each; the ranks' gradient exchange starts in
  // the last one's backward. Returns the loss sum.
  double accumulate(const std::vector<data::Batch>& micro_batches,
                    const std::function<MicroBatchLoss(const data::Batch&)>& forward);
  // One micro-batch's preference loss, to be backpropagated at `weight` (loss scale / micro-batches
  // of the window); its metrics are added to `metric_sums` once its backward has been queued.
  MicroBatchLoss preference_micro_batch(const data::Batch& batch, double weight,
                                        std::vector<std::pair<std::string, double>>& metric_sums);

  LlamaForCausalLMImpl& model_;
  std::vector<torch::Tensor> trainable_;
  optim::Optimizer& optimizer_;
  LossScaler& scaler_;
  TrainingStepOptions options_;
  ProcessGroup* group_ = nullptr;
  GradientBuckets* buckets_ = nullptr;
  // train.optimizer_states_on_host: each layer's update in the next forward, its state from the host.
  std::unique_ptr<DeferredUpdate> deferred_update_;
  MemoryPhases* phases_ = nullptr;
  void mark_phase(const char* phase) {
    if (phases_) phases_->mark(phase);
  }
};

}  // namespace qtrain::trainer
