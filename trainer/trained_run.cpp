#include "trainer/trained_run.h"

#include "kernels/error.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/formats/training_checkpoint.h"

namespace qtrain::trainer {

namespace {

// The directory the run's trained weights come from when no checkpoint is named: RUN/adapter
// for a LoRA run; the last checkpoint for runs whose weights an adapter cannot hold (full
// weights, and QAT's quantizer state).
std::string final_weights_source(const std::string& run_dir, const Recipe& recipe) {
  if (!trains_full_weights(recipe) && recipe.quant != QuantMethod::kQat) return run_dir + "/adapter";
  const auto newest = newest_valid_checkpoint(run_dir);
  if (!newest) {
    throw Error(ErrorCode::kCheckpoint, run_dir + "/checkpoints: no valid checkpoint, and this run (" +
                (recipe.quant == QuantMethod::kQat ? std::string("quant: qat") : std::string("full weights")) +
                ") keeps its trained weights there; did it finish?");
  }
  return *newest;
}

}  // namespace

TrainedRun load_trained_run(const std::string& run_dir, const std::string& checkpoint, bool quantize_base) {
  TrainedRun run;
  if (checkpoint.empty()) {
    run.recipe = load_recipe(run_dir + "/recipe.yaml", {});
    run.adapter_source = final_weights_source(run_dir, run.recipe);
  } else {
    run.adapter_source =
        checkpoint.find('/') == std::string::npos ? run_dir + "/checkpoints/" + checkpoint : checkpoint;
  }
  const auto dtype = [](const Recipe& recipe) { return parse_dtype_name(recipe.train.dtype, "train.dtype"); };
  if (run.adapter_source == run_dir + "/adapter") {
    run.loaded = load_base_model(run.recipe, dtype(run.recipe), torch::kCPU, quantize_base);
    apply_peft_adapter(*run.loaded.model, run.adapter_source);
    run.adapter = read_peft_adapter_config(run.adapter_source);
    return run;
  }
  const auto state = read_training_checkpoint(run.adapter_source);
  run.recipe = load_recipe(run.adapter_source + "/recipe.yaml", {});
  run.adapter = lora_adapter_config(run.recipe);
  run.loaded = load_base_model(run.recipe, dtype(run.recipe), torch::kCPU, quantize_base);
  auto& model = *run.loaded.model;
  if (!trains_full_weights(run.recipe)) {
    qat::apply_lora(model, run.adapter.targets, [&](const std::string& name) { return run.adapter.options_for(name); });
  }
  apply_recipe_qat(model, run.recipe, &run.loaded.config);
  size_t trained = qat_state_buffers(model).size();
  for (const auto& item : model.named_parameters()) trained += is_trained_parameter(run.recipe, item.key()) ? 1 : 0;
  load_trainable_tensors(model, state.trainable, trained, run.adapter_source);
  if (run.recipe.quant == QuantMethod::kQat) qat::set_fake_quant_enabled(model, true);
  return run;
}

}  // namespace qtrain::trainer
