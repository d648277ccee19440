#include "trainer/run_model.h"

#include "trainer/recipe_training.h"
#include "trainer/training_checkpoint.h"

namespace qtrain::trainer {

RunModel load_run_model(const std::string& run_dir, const std::string& checkpoint, bool quantize_base) {
  RunModel run;
  if (checkpoint.empty()) {
    run.recipe = load_recipe(run_dir + "/recipe.yaml", {});
    run.adapter_source = run_dir + "/adapter";
    run.loaded = load_base_model(run.recipe, parse_dtype_name(run.recipe.train.dtype, "train.dtype"), torch::kCPU,
                              quantize_base);
    apply_peft_adapter(*run.loaded.model, run.adapter_source);
    run.adapter = read_peft_adapter_config(run.adapter_source);
    return run;
  }
  run.adapter_source =
      checkpoint.find('/') == std::string::npos ? run_dir + "/checkpoints/" + checkpoint : checkpoint;
  const auto state = read_training_checkpoint(run.adapter_source);
  run.recipe = load_recipe(run.adapter_source + "/recipe.yaml", {});
  run.adapter = lora_adapter_config(run.recipe);
  run.loaded = load_base_model(run.recipe, parse_dtype_name(run.recipe.train.dtype, "train.dtype"), torch::kCPU,
                              quantize_base);
  const auto adapted = qat::apply_lora(*run.loaded.model, run.adapter.targets,
                                       [&](const std::string& name) { return run.adapter.options_for(name); });
  load_trainable_tensors(*run.loaded.model, state.trainable, 2 * adapted.size(), run.adapter_source);
  return run;
}

}  // namespace qtrain::trainer
