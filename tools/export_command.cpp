// qtrain export --run DIR --format peft --out DIR: what a run trained, in a format other tools load.
#include <cstdio>
#include <filesystem>

#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/file_system.h"
#include "trainer/hf_checkpoint.h"
#include "trainer/peft_adapter.h"
#include "trainer/recipe.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_export(const Arguments& arguments) {
  std::string run_dir, format, out_dir;
  po::options_description options("export options");
  options.add_options()
      ("run", po::value(&run_dir)->required(), "run directory (train.output_dir of a finished run)")
      ("format", po::value(&format)->default_value("peft"), "peft (merged, gguf, safetensors-int come later)")
      ("out", po::value(&out_dir)->required(), "directory to write; must not exist unless --force")
      ("force", po::bool_switch(), "replace an existing --out directory");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain export --run DIR --format peft --out DIR [--force]", options, arguments,
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
  const auto recipe = trainer::load_recipe(run_dir + "/recipe.yaml", {});
  const std::string adapter_dir = run_dir + "/adapter";
  // The adapter is checked against the base it was trained on: every tensor, every shape.
  auto loaded = trainer::load_llama(recipe.model.path);
  trainer::apply_peft_adapter(*loaded.model, adapter_dir);
  const std::string staged = out_dir + ".staging";
  trainer::remove_tree(staged);
  trainer::write_peft_adapter(*loaded.model, trainer::read_peft_adapter_config(adapter_dir), staged, recipe.model.path);
  trainer::replace_directory(staged, out_dir);
  std::printf("export: PEFT adapter of %s written to %s\n", run_dir.c_str(), out_dir.c_str());
  return 0;
}

}  // namespace qtrain::tools
