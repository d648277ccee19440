#pragma once
// Training-state checkpoints: everything a run needs to continue exactly where it stopped.
//
//   RUN/checkpoints/step-000500/
//     trainable.safetensors   the trainable weights, by the model's parameter names, and a QAT
//                             run's quantizer state (observer ranges, zero points), by buffer name
//     optimizer.safetensors   the optimizer's state ("<parameter index>.<field>")
//     random.safetensors      the CPU (and GPU) generators' states
//     state.json              step and token counters, data loader position, loss scaler
//     recipe.yaml             the resolved recipe of the run that wrote it
//     manifest.json           size and CRC-32C of every file above; written last
//
// A checkpoint is written into a hidden staging directory, every file fsynced, then renamed
// into place and the parent directory fsynced: a crash leaves the previous checkpoints and at
// most a staging directory, never a half checkpoint under a step name. A checkpoint counts only
// when its manifest verifies.
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace qtrain::trainer {

using NamedTensorList = std::vector<std::pair<std::string, torch::Tensor>>;

struct TrainingCheckpoint {
  NamedTensorList trainable;
  NamedTensorList optimizer;
  NamedTensorList random_states;
  nlohmann::json state;
  std::string recipe_yaml;
};

std::string checkpoint_name(int64_t step);  // "step-000500"

// Copies a checkpoint's trainable tensors into the parameters (or, for QAT state, the buffers) of
// `model` of the same names.
// `expected_count` is how many the model trains; Error naming the checkpoint (`source`) and the
// tensor when a name is missing, a shape differs or the counts differ (another LoRA shape).
void load_trainable_tensors(torch::nn::Module& model, const NamedTensorList& tensors, size_t expected_count,
                            const std::string& source);

// Writes RUN/checkpoints/step-N atomically (replacing an older one of the same step).
std::string write_training_checkpoint(const std::string& run_dir, int64_t step, const TrainingCheckpoint& checkpoint);

// Error naming the checkpoint and the file when the manifest is missing or a file's size or
// checksum differs.
void verify_training_checkpoint(const std::string& directory);
// Verifies, then reads.
TrainingCheckpoint read_training_checkpoint(const std::string& directory);

// The complete checkpoints of a run (manifest present), oldest first.
std::vector<std::string> list_training_checkpoints(const std::string& run_dir);
// The newest checkpoint that verifies; the ones that do not are reported on stderr and skipped.
std::optional<std::string> newest_valid_checkpoint(const std::string& run_dir);
// Removes all but the newest keep_last checkpoints (0 keeps all), and stale staging directories.
void prune_training_checkpoints(const std::string& run_dir, int64_t keep_last);

}  // namespace qtrain::trainer
