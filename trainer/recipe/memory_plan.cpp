#include "trainer/recipe/memory_plan.h"

#include "trainer/objectives/objectives.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {

namespace {

// The copies of lm_head (each micro-batch) and of the optimizer's state (each step) hide behind
// the layers only where there is enough work to hide them. Queued behind the batch's own copies
// (each on its lane, lm_head's after the embedding rows), both on cost 0.99x the tokens/s at the
// 8B shape's micro-batch 1 x 2048 on one H200 (9,750 vs 9,829, 2026-11-29); before that queueing
// they cost 0.88x, so a shorter step is left as it was.
constexpr int64_t kTokensThatHideACopy = 2048;

std::string too_short(const char* what, int64_t tokens) {
  if (tokens >= kTokensThatHideACopy) return "";
  return std::string("a ") + what + " of " + std::to_string(tokens) + " tokens may be too short to hide the copy (" +
         "measured 0.99x the tokens/s at 2,048 tokens on the 8B shape); on from " + std::to_string(kTokensThatHideACopy) +
         " tokens";
}

// One switch: on already, turned on, or left off with the reason `refusal` gives.
MemoryChoice choose(bool& field, const char* key, const std::string& refusal, const char* gain) {
  if (field) return {key, true, "set in the recipe"};
  if (!refusal.empty()) return {key, false, refusal};
  field = true;
  return {key, true, gain};
}

}  // namespace

std::vector<MemoryChoice> plan_memory(Recipe& recipe, bool tied_embeddings, bool on_gpu) {
  if (recipe.train.memory != "auto" || !on_gpu) return {};
  auto& train = recipe.train;
  std::vector<MemoryChoice> choices;
  choices.push_back(choose(train.offload_activations, "train.offload_activations",
                           train.gradient_checkpointing ? "" : "it offloads what checkpointing keeps, and train.gradient_checkpointing is off",
                           "the checkpointed layer inputs wait in host memory"));
  choices.push_back(choose(train.embeddings_on_host, "train.embeddings_on_host",
                           embeddings_on_host_refusal(recipe, tied_embeddings), "the frozen input table stays on the host"));
  const int64_t micro_batch_tokens =
      train.micro_batch_size * longest_row_tokens(train.objective, recipe.data.max_seq_len);
  const std::string head_refusal = lm_head_on_host_refusal(recipe, tied_embeddings);
  choices.push_back(choose(train.lm_head_on_host, "train.lm_head_on_host",
                           head_refusal.empty() ? too_short("micro-batch", micro_batch_tokens) : head_refusal,
                           "the frozen lm_head visits the GPU for the loss only"));
  choices.push_back(choose(train.optimizer_states_on_host, "train.optimizer_states_on_host",
                           trains_full_weights(recipe)
                               ? "every weight trains: the state is twice the model, too much to pin on the host unasked"
                               : too_short("step", micro_batch_tokens * train.grad_accum_steps),
                           "the optimizer's state waits on the host between steps"));
  return choices;
}

std::vector<std::string> describe_memory_plan(const Recipe& recipe, const std::vector<MemoryChoice>& choices, bool on_gpu) {
  if (recipe.train.memory != "auto") return {"memory: manual: the train.* switches as set"};
  if (!on_gpu) return {"memory: auto: on the CPU the host is the device; no switch to turn on"};
  std::vector<std::string> lines;
  for (const auto& choice : choices) {
    lines.push_back("memory: auto: " + choice.key + (choice.on ? " on (" : " off (") + choice.why + ")");
  }
  lines.push_back("memory: auto: train.keep_built_weights " + std::string(recipe.train.keep_built_weights ? "true" : "false") +
                  ", train.mlp_chunk_tokens " + std::to_string(recipe.train.mlp_chunk_tokens) +
                  " and train.expert_bank_block_mb " + std::to_string(recipe.train.expert_bank_block_mb) +
                  " as set (they trade speed for memory); train.memory: manual keeps every switch as set");
  return lines;
}

}  // namespace qtrain::trainer
