// qtrain export --run DIR --format peft --out DIR: what a run trained, in a format other tools load.
#include <cstdio>
#include <filesystem>

#include "kernels/error.h"
#include "qat/lora_linear.h"
#include "tools/commands.h"
#include "trainer/file_system.h"
#include "trainer/hf_checkpoint.h"
#include "trainer/peft_adapter.h"
#include "trainer/recipe.h"
#include "trainer/recipe_training.h"
#include "trainer/training_checkpoint.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_export(const Arguments& arguments) {
  std::string run_dir, format, out_dir, checkpoint;
  po::options_description options("export options");
  options.add_options()
      ("run", po::value(&run_dir)->required(), "run directory (train.output_dir of a finished run)")
      ("checkpoint", po::value(&checkpoint)->default_value(""),
       "a training-state checkpoint of the run (step-000500) instead of its final adapter")
      ("format", po::value(&format)->default_value("peft"), "peft (merged, gguf, safetensors-int come later)")
      ("out", po::value(&out_dir)->required(), "directory to write; must not exist unless --force")
      ("force", po::bool_switch(), "replace an existing --out directory");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain export --run DIR [--checkpoint step-N] --format peft --out DIR [--force]", options, arguments,
                          values)) {
    return 0;
  }
  if (format != "peft") {
    throw Error("--format " + format + " is not available yet (peft now; merged with Inference export 9/11, "
                "gguf and safetensors-int with QAT 6/11)");
  }
  const bool force = values["force"].as<bool>();
  if (std::filesystem::exists(out_dir) && !force) {
    throw Error(out_dir + ": already exists; choose another --out or pass --force to replace it");
  }
  const std::string staged = out_dir + ".staging";
  trainer::remove_tree(staged);
  if (checkpoint.empty()) {
    const auto recipe = trainer::load_recipe(run_dir + "/recipe.yaml", {});
    const std::string adapter_dir = run_dir + "/adapter";
    // The adapter is checked against the base it was trained on: every tensor, every shape.
    auto loaded = trainer::load_llama(recipe.model.path);
    trainer::apply_peft_adapter(*loaded.model, adapter_dir);
    trainer::write_peft_adapter(*loaded.model, trainer::read_peft_adapter_config(adapter_dir), staged,
                                recipe.model.path);
  } else {
    const std::string checkpoint_dir =
        checkpoint.find('/') == std::string::npos ? run_dir + "/checkpoints/" + checkpoint : checkpoint;
    const auto state = trainer::read_training_checkpoint(checkpoint_dir);
    const auto recipe = trainer::load_recipe(checkpoint_dir + "/recipe.yaml", {});
    const auto adapter = trainer::lora_adapter_config(recipe);
    auto loaded = trainer::load_llama(recipe.model.path);
    const auto adapted = qat::apply_lora(*loaded.model, adapter.targets, adapter.lora);
    trainer::load_trainable_tensors(*loaded.model, state.trainable, 2 * adapted.size(), checkpoint_dir);
    trainer::write_peft_adapter(*loaded.model, adapter, staged, recipe.model.path);
  }
  trainer::replace_directory(staged, out_dir);
  std::printf("export: PEFT adapter of %s written to %s\n", run_dir.c_str(), out_dir.c_str());
  return 0;
}

}  // namespace qtrain::tools
