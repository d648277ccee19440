#pragma once
// The model a run trained, rebuilt from its run directory for export: the base as training built
// it (trainer/recipe/recipe_training.h) with the run's trained weights, either the final ones or those
// of a training-state checkpoint (RUN/checkpoints/step-N). The final weights of a LoRA run are
// its adapter (RUN/adapter); those of a full-weights or QAT run, its last checkpoint (which also
// holds the quantizers' state). A QAT run comes back with its QatLinear layers, fake quant on.
#include <string>

#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

struct TrainedRun {
  Recipe recipe;               // the run's (or the checkpoint's) resolved recipe
  LoadedModel loaded;          // on the CPU, in train.dtype, LoRA layers in place
  PeftAdapterConfig adapter;   // what the LoRA layers are, for writing them as a PEFT adapter
  std::string adapter_source;  // the adapter or checkpoint directory the trained weights came from
};

// `checkpoint`: empty for the final adapter, a checkpoint name (step-000500) under
// RUN/checkpoints, or a path. quantize_base as in load_base_model: a merge needs the base the
// adapter was trained on, a PEFT export only its shapes. Every LoRA tensor is checked against
// the base (name and shape); Error naming the directory otherwise.
TrainedRun load_trained_run(const std::string& run_dir, const std::string& checkpoint, bool quantize_base);

}  // namespace qtrain::trainer
