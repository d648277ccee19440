#pragma once
// train.memory: auto, the default: the memory switches a run gets without setting them. On a GPU
// it turns on, where the run allows them, the switches whose cost in tokens/s was within the
// noise when measured (docs/PERFORMANCE.md):
//   train.offload_activations       with gradient checkpointing: the checkpointed inputs wait on
//                                   the host (copies overlap the layers, on a side stream)
//   train.embeddings_on_host        the frozen input table; a batch's rows are gathered there
//   train.lm_head_on_host           the frozen head, copied in on a side stream during forward,
//                                   where its bytes are a small share of a micro-batch's work
//   train.optimizer_states_on_host  the optimizer's state between steps (the same updates), where
//                                   its bytes are a small share of a step's work (measured shares:
//                                   memory_plan.cpp), and only for adapters (full fine-tuning's
//                                   state is the model twice)
//   train.lm_head_block_mb          256 with lm_head on the host and the fused loss, where the
//                                   estimated peak falls by a fifth or more (lm_head's whole visit
//                                   sets it); this one costs 4-6% of a short micro-batch's step
//   train.offload_branch_outputs    with the offload: each layer's attention output waits on the
//                                   host too, and the recomputation reads it back (1.00-1.04x the
//                                   tokens/s, the same device peak, twice the pinned host bytes)
// A tied table goes to the host only as the pair of the two table switches, by lm_head's share as
// an untied head (or where the recipe set one of them). A switch the run cannot take (a trained,
// adapted or fake-quantized table or head; no checkpointing) stays off, said why. It never turns a
// switch off.
//
// What costs speed it leaves as set, unless the estimated peak (trainer/recipe/model_memory.h)
// would not fit the GPU's free memory: then, cheapest first, each of these goes on while it lowers
// the estimate, until the estimate fits with a margin: train.optimizer_states_on_host (where it
// was left off for its copy), train.keep_built_weights: false, train.expert_bank_block_mb: 256,
// train.lm_head_block_mb: 256. Each says what it cost where measured; a run that fits even so
// not is told to shorten its micro-batch. train.mlp_chunk_tokens stays as set. On the CPU (the
// host is the device) and under train.memory: manual it changes nothing.
#include <string>
#include <vector>

#include "trainer/model/llama_options.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

struct MemoryChoice {
  std::string key;  // train.offload_activations, ...; empty: a line about the plan as a whole
  bool on = false;  // what the run does
  std::string why;
};

// Applies train.memory to `recipe`'s switches for `model` (its config.json's shape) and returns
// each switch's choice (none under manual). `device_bytes`: the GPU memory the run may take (its
// free memory at the start; bench's --memory-limit-gib), 0 where unknown: nothing is fitted to it.
std::vector<MemoryChoice> plan_memory(Recipe& recipe, const LlamaOptions& model, bool on_gpu, double device_bytes = 0);

// The lines the run's start and `inspect --recipe` print: "memory: auto: train.X on (why)".
std::vector<std::string> describe_memory_plan(const Recipe& recipe, const std::vector<MemoryChoice>& choices,
                                              bool on_gpu);

}  // namespace qtrain::trainer
