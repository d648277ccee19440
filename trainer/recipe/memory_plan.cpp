#include "trainer/recipe/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iomanip>
#include <sstream>

#include "trainer/base/memory_stats.h"
#include "trainer/objectives/objectives.h"
#include "trainer/recipe/model_memory.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {

namespace {

// lm_head's copy (each micro-batch) and the optimizer state's (in and out each step) hide behind
// the layers where they are small beside the work. Measured on one H200 (2026-11-29, micro-batch
// 1 x 2048, docs/PERFORMANCE.md), in bytes copied per FLOP (HostCopyWork's 6 x active weights):
//   llama3-8b:  lm_head 1.1e-5, state 7.3e-6: both on, 0.985x the tokens/s of both off
//   qwen3-8b:   lm_head 1.3e-5, state 7.5e-6: both on, 0.98x
//   qwen3-30b-a3b, 12 layers: lm_head 5.1e-5 alone 1.0x; state 2.1e-4 alone 0.86x when the whole
//   state came back in the last backward, 0.93x (and 7.53 -> 6.39 GiB) since each layer's share
//   travels in the next forward (trainer/deferred_update.h, seventeenth session); llama3-8b
//   micro-batch 4 then 0.985x of the state on the device (5.90 -> 5.69 GiB). With lm_head's copy
//   in a piece a layer (eighteenth session), the state on the host ran 1.07x faster at the MoE
//   and 1.05x at phi4-mini micro-batch 4 FP8, about 0.94x and 0.99x of the state on the device in
//   another call: not yet measured side by side, so the limit stays.
// Each goes on up to a little above the largest share that hid, from the shortest micro-batch
// measured. A window of several micro-batches applies the update in its first forward only, so
// the step's tokens count.
constexpr double kLmHeadBytesPerFlop = 6e-5;
constexpr double kStateBytesPerFlop = 1e-5;
constexpr int64_t kShortestMeasuredTokens = 2048;

std::string scientific(double value) {
  std::ostringstream text;
  text << std::scientific << std::setprecision(1) << value;
  return text.str();
}

// Why a copy of `bytes` each `what` (of `tokens` tokens) would not hide; "" where it would.
std::string copy_refusal(const std::string& what, double bytes, int64_t tokens, double flops_per_token, double most) {
  if (tokens < kShortestMeasuredTokens) {
    return "a " + what + " of " + std::to_string(tokens) + " tokens may be too short to hide the copy (measured from " +
           std::to_string(kShortestMeasuredTokens) + " tokens)";
  }
  const double share = bytes / (flops_per_token * static_cast<double>(tokens));
  if (share <= most) return "";
  return "its copy is " + scientific(share) + " bytes per FLOP of the " + what + "'s work, more than the " +
         scientific(most) + " measured to hide behind it";
}

// One switch: on already, turned on, or left off with the reason `refusal` gives.
MemoryChoice choose(bool& field, const char* key, const std::string& refusal, const char* gain) {
  if (field) return {key, true, "set in the recipe"};
  if (!refusal.empty()) return {key, false, refusal};
  field = true;
  return {key, true, gain};
}

// A tied table goes to the host whole, under train.embeddings_on_host and train.lm_head_on_host
// together; its copy is lm_head's, weighed as an untied lm_head's is. Measured on one H200
// (2026-11-29, micro-batch 1 / 4 x 2048): phi4-mini 1.09x / 1.01x the tokens/s of the table on the
// GPU (shares 2.6e-5 / 6.5e-6), gemma2-9b 0.97x / 0.99x (1.6e-5 / 4.0e-6).
void choose_tied_table(Recipe& recipe, const HostCopyWork& work, int64_t micro_batch_tokens,
                       std::vector<MemoryChoice>& choices) {
  auto& train = recipe.train;
  Recipe paired = recipe;
  paired.train.embeddings_on_host = paired.train.lm_head_on_host = true;
  std::string refusal = embeddings_on_host_refusal(paired, true);
  if (refusal.empty()) refusal = lm_head_on_host_refusal(paired, true);
  if (refusal.empty() && !train.embeddings_on_host && !train.lm_head_on_host) {
    refusal = copy_refusal("micro-batch", work.lm_head_bytes, micro_batch_tokens, work.flops_per_token,
                           kLmHeadBytesPerFlop);
    if (!refusal.empty()) refusal = "the table is tied (tie_word_embeddings), and " + refusal;
  }
  const char* gain = "the tied table waits on the host and visits the GPU for the loss only";
  choices.push_back(choose(train.embeddings_on_host, "train.embeddings_on_host", refusal, gain));
  choices.push_back(choose(train.lm_head_on_host, "train.lm_head_on_host", refusal, gain));
}

// train.lm_head_block_mb: lm_head on the host visits the fused loss a tile at a time, at most this
// many MB of it on the device, where that takes at least kLeastTileSaving of the estimated peak
// (lm_head's whole visit sets it: a large vocabulary beside a short micro-batch). Its copy is then
// exposed, and cost about 6% of the step wherever measured (one H200, 2026-11-29, 256 MB):
// phi4-mini micro-batch 1 3.07 -> 2.37 GiB (estimate: 26% off) at 0.94x the tokens/s, micro-batch 4
// 3.46 -> 3.09 GiB (13%) at about 0.94x, gemma2-9b micro-batch 1 6.25 -> 5.60 GiB (13%) at 0.96x.
// So only a cut of a fifth or more pays for it.
constexpr int64_t kLmHeadBlockMb = 256;
constexpr double kLeastTileSaving = 0.20;

MemoryChoice choose_lm_head_tiles(Recipe& recipe, const LlamaOptions& model) {
  const char* key = "train.lm_head_block_mb";
  auto& train = recipe.train;
  if (train.lm_head_block_mb > 0) return {key, true, "set in the recipe"};
  if (!train.lm_head_on_host) return {key, false, "lm_head stays on the device"};
  const std::string refusal = lm_head_on_host_refusal(recipe, model.tie_word_embeddings);
  if (!refusal.empty()) return {key, false, refusal};
  const double whole = estimate_peak_memory(model, training_memory_setup(recipe, model)).total();
  Recipe tiled = recipe;
  tiled.train.lm_head_block_mb = kLmHeadBlockMb;
  const auto estimate = estimate_peak_memory(model, training_memory_setup(tiled, model));
  if (!estimate.visits_in_tiles) return {key, false, "the loss is not the fused one, which walks the tiles"};
  const double saving = 1.0 - estimate.total() / whole;
  std::ostringstream why;
  why << "lm_head visiting the loss in tiles of at most " << kLmHeadBlockMb << " MB would take "
      << static_cast<int>(std::lround(100 * saving)) << "% off the estimated peak ("
      << format_bytes(whole) << " -> " << format_bytes(estimate.total()) << ")";
  if (saving < kLeastTileSaving) {
    why << ", less than the " << static_cast<int>(100 * kLeastTileSaving)
        << "% that pays for the copy it exposes: it visits whole";
    return {key, false, why.str()};
  }
  train.lm_head_block_mb = kLmHeadBlockMb;
  why << "; its copy, exposed, cost about 6% of the step where measured";
  return {key, true, why.str()};
}

// train.offload_branch_outputs: with the inputs offloaded, each layer's o_proj output (and under
// sandwich norms its MLP's) waits on the host beside the input, and the recomputation reads it back
// instead of computing that product again. Measured on one H200 (2026-11-29, s49, alternated in
// one job): llama3-8b micro-batch 1 / 4 1.015x / 1.010x, qwen3-8b micro-batch 4 1.014x (FP8
// compute 1.002x), gemma2-9b micro-batch 1 / 4 1.001x / 1.036x; the same device peak, twice the
// pinned host memory of the offload. It never cost speed, so it goes on with the offload.
MemoryChoice choose_branch_outputs(Recipe& recipe) {
  return choose(recipe.train.offload_branch_outputs, "train.offload_branch_outputs",
                recipe.train.offload_activations ? "" : "it offloads beside the layer inputs, and train.offload_activations is off",
                "each layer's attention output waits on the host beside its input, and the recomputation reads it "
                "back instead of computing o_proj again");
}

// The share of the device's free bytes the estimated peak may take: the caching allocator's
// rounding and cached blocks, cuBLAS's workspaces and the estimate's own error (it came 1-3% under
// the measured peaks of the bench shapes).
constexpr double kFitShare = 0.9;

double estimated_peak(const Recipe& recipe, const LlamaOptions& model) {
  return estimate_peak_memory(model, training_memory_setup(recipe, model)).total();
}

// A switch that costs speed, for a run that would not fit otherwise: whether the run can take it
// (and has not), and what it cost where measured.
struct FittingSwitch {
  const char* key;
  std::function<bool(Recipe&, const LlamaOptions&)> turn_on;  // false: not for this run
  const char* cost;
};

const std::vector<FittingSwitch>& fitting_switches() {
  static const std::vector<FittingSwitch> switches = {
      {"train.optimizer_states_on_host",
       [](Recipe& recipe, const LlamaOptions&) {
         if (recipe.train.optimizer_states_on_host || trains_full_weights(recipe)) return false;
         return recipe.train.optimizer_states_on_host = true;
       },
       "0.93x the tokens/s for the 1.3 GB state of 12 Qwen3-30B-A3B layers' experts, less for a smaller state"},
      {"train.keep_built_weights",
       [](Recipe& recipe, const LlamaOptions&) {
         if (!recipe.train.keep_built_weights || !recipe.train.gradient_checkpointing) return false;
         recipe.train.keep_built_weights = false;
         return true;
       },
       "about 8% of the step: each layer's base weights built again in backward"},
      {"train.expert_bank_block_mb",
       [](Recipe& recipe, const LlamaOptions& model) {
         if (recipe.train.expert_bank_block_mb > 0 || model.experts.num_experts == 0) return false;
         recipe.train.expert_bank_block_mb = 256;
         return true;
       },
       "0.88x-0.98x the tokens/s of Qwen3-30B-A3B's whole banks where measured"},
      {"train.lm_head_block_mb",
       [](Recipe& recipe, const LlamaOptions&) {
         if (recipe.train.lm_head_block_mb > 0 || !recipe.train.lm_head_on_host) return false;
         recipe.train.lm_head_block_mb = kLmHeadBlockMb;
         return true;
       },
       "about 6% of a short micro-batch's step: lm_head's copy exposed"},
  };
  return switches;
}

// Turns on fitting_switches() in order while the estimated peak is above `device_bytes`' share,
// each only where it lowers the estimate; replaces a switch's earlier choice, or adds one.
void fit_to_device(Recipe& recipe, const LlamaOptions& model, double device_bytes, std::vector<MemoryChoice>& choices) {
  const double room = kFitShare * device_bytes;
  double peak = estimated_peak(recipe, model);
  if (peak <= room) return;
  const std::string free = "the GPU's " + format_bytes(device_bytes) + " free";
  for (const auto& candidate : fitting_switches()) {
    if (peak <= room) break;
    Recipe trial = recipe;
    if (!candidate.turn_on(trial, model)) continue;
    const double lowered = estimated_peak(trial, model);
    if (lowered >= peak) continue;
    std::ostringstream why;
    why << "to fit " << free << ": the estimated peak " << format_bytes(peak) << " -> " << format_bytes(lowered)
        << "; it costs " << candidate.cost;
    recipe = trial;
    peak = lowered;
    MemoryChoice choice{candidate.key, true, why.str()};
    const auto found = std::find_if(choices.begin(), choices.end(),
                                    [&](const MemoryChoice& earlier) { return earlier.key == candidate.key; });
    if (found != choices.end()) {
      *found = choice;
    } else {
      choices.push_back(choice);
    }
  }
  if (peak > room) {
    choices.push_back({"", false,
                       "the estimated peak " + format_bytes(peak) + " is more than " +
                           std::to_string(static_cast<int>(std::lround(100 * kFitShare))) + "% of " + free +
                           " even so: lower train.micro_batch_size (and raise train.grad_accum_steps) or data.max_seq_len"});
  }
}

}  // namespace

std::vector<MemoryChoice> plan_memory(Recipe& recipe, const LlamaOptions& model, bool on_gpu, double device_bytes) {
  if (recipe.train.memory != "auto" || !on_gpu) return {};
  auto& train = recipe.train;
  const bool tied_embeddings = model.tie_word_embeddings;
  const auto work = host_copy_work(model, recipe);
  std::vector<MemoryChoice> choices;
  choices.push_back(choose(train.offload_activations, "train.offload_activations",
                           train.gradient_checkpointing ? "" : "it offloads what checkpointing keeps, and train.gradient_checkpointing is off",
                           "the checkpointed layer inputs wait in host memory"));
  const int64_t micro_batch_tokens =
      train.micro_batch_size * longest_row_tokens(train.objective, recipe.data.max_seq_len);
  if (tied_embeddings) {
    choose_tied_table(recipe, work, micro_batch_tokens, choices);
  } else {
    choices.push_back(choose(train.embeddings_on_host, "train.embeddings_on_host",
                             embeddings_on_host_refusal(recipe, false), "the frozen input table stays on the host"));
    const std::string head_refusal = lm_head_on_host_refusal(recipe, false);
    choices.push_back(choose(train.lm_head_on_host, "train.lm_head_on_host",
                             head_refusal.empty() ? copy_refusal("micro-batch", work.lm_head_bytes, micro_batch_tokens,
                                                                 work.flops_per_token, kLmHeadBytesPerFlop)
                                                  : head_refusal,
                             "the frozen lm_head visits the GPU for the loss only"));
  }
  choices.push_back(choose(train.optimizer_states_on_host, "train.optimizer_states_on_host",
                           trains_full_weights(recipe)
                               ? "every weight trains: the state is twice the model, too much to pin on the host unasked"
                               : copy_refusal("step", work.state_bytes, micro_batch_tokens * train.grad_accum_steps,
                                              work.flops_per_token, kStateBytesPerFlop),
                           "the optimizer's state waits on the host between steps"));
  choices.push_back(choose_branch_outputs(recipe));
  choices.push_back(choose_lm_head_tiles(recipe, model));
  if (device_bytes > 0) fit_to_device(recipe, model, device_bytes, choices);
  return choices;
}

std::vector<std::string> describe_memory_plan(const Recipe& recipe, const std::vector<MemoryChoice>& choices, bool on_gpu) {
  if (recipe.train.memory != "auto") return {"memory: manual: the train.* switches as set"};
  if (!on_gpu) return {"memory: auto: on the CPU the host is the device; no switch to turn on"};
  std::vector<std::string> lines;
  for (const auto& choice : choices) {
    if (choice.key.empty()) {
      lines.push_back("memory: auto: " + choice.why);
      continue;
    }
    lines.push_back("memory: auto: " + choice.key + (choice.on ? " on (" : " off (") + choice.why + ")");
  }
  lines.push_back("memory: auto: train.keep_built_weights " + std::string(recipe.train.keep_built_weights ? "true" : "false") +
                  ", train.mlp_chunk_tokens " + std::to_string(recipe.train.mlp_chunk_tokens) +
                  " and train.expert_bank_block_mb " + std::to_string(recipe.train.expert_bank_block_mb) +
                  " (they trade speed for memory: as set, or as chosen above to fit the GPU); train.memory: manual keeps "
                  "every switch as set");
  return lines;
}

}  // namespace qtrain::trainer
