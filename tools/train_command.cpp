// qtrain [train] --recipe FILE: resolves the recipe (defaults, file, --set overrides).
#include <iostream>

#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/recipe.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_train(const Arguments& arguments) {
  std::string recipe_path;
  std::vector<std::string> overrides;
  po::options_description options("train options");
  options.add_options()
      ("recipe", po::value(&recipe_path)->required(), "YAML recipe (see recipes/)")
      ("set", po::value(&overrides)->composing(), "override a recipe key: --set optim.lr=2e-4 (repeatable)")
      ("print-recipe", po::bool_switch(), "print the resolved recipe (every key) as YAML and exit");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain [train] --recipe FILE [--set key=value ...] [--print-recipe]", options,
                          arguments, values)) {
    return 0;
  }
  const auto recipe = trainer::load_recipe(recipe_path, overrides);
  if (values["print-recipe"].as<bool>()) {
    std::cout << trainer::recipe_to_yaml(recipe);
    return 0;
  }
  throw Error(recipe_path +
              ": the recipe is valid, but this build has no training loop yet (it arrives with QLoRA 2/11); "
              "use --print-recipe to check a recipe, and `qtrain eval` to evaluate a model");
}

}  // namespace qtrain::tools
