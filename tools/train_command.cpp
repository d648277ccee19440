// qtrain [train] --recipe FILE: resolves the recipe (defaults, file, --set overrides) and trains.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "tools/commands.h"
#include "trainer/finetune.h"
#include "trainer/dist/launch_environment.h"
#include "trainer/recipe/recipe.h"
#include "trainer/stop_signal.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_train(const Arguments& arguments) {
  std::string recipe_path, resume;
  std::vector<std::string> overrides;
  po::options_description options("train options");
  options.add_options()
      ("recipe", po::value(&recipe_path)->required(), "YAML recipe (see recipes/)")
      ("set", po::value(&overrides)->composing(), "override a recipe key: --set optim.lr=2e-4 (repeatable)")
      ("resume", po::value(&resume)->default_value(""),
       "auto: continue from the newest valid checkpoint of train.output_dir (fresh if none); or a checkpoint directory")
      ("print-recipe", po::bool_switch(), "print the resolved recipe (every key) as YAML and exit")
      ("no-progress", po::bool_switch(), "no progress line redrawn on the terminal: plain lines, as when stdout is a file");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain [train] --recipe FILE [--set key=value ...] [--resume auto|DIR] [--print-recipe] [--no-progress]", options,
                          arguments, values)) {
    return 0;
  }
  const auto recipe = trainer::load_recipe(recipe_path, overrides);
  if (values["print-recipe"].as<bool>()) {
    std::cout << trainer::recipe_to_yaml(recipe);
    return 0;
  }
  // Ranks other than 0 would repeat rank 0's progress lines; their warnings and errors still
  // reach stderr.
  if (trainer::read_launch_environment().rank > 0) std::freopen("/dev/null", "w", stdout);
  trainer::install_stop_signal_handlers();
  trainer::Finetune finetune(recipe, resume);
  finetune.set_progress_line(trainer::stdout_is_terminal() && !values["no-progress"].as<bool>());
  finetune.setup();
  const auto summary = finetune.train();
  if (summary.stopped) {
    std::printf("stopped after step %lld: checkpoint in %s\nresume with: qtrain --recipe %s%s --resume auto\n",
                static_cast<long long>(summary.steps), summary.checkpoint_dir.c_str(), recipe_path.c_str(),
                overrides.empty() ? "" : " --set ... (the same overrides)");
    return 0;
  }
  // A resumed run has no eval of its own start (NaN): only the final loss is reported.
  char eval[96] = "no eval data";
  if (!std::isnan(summary.first_eval_loss)) {
    std::snprintf(eval, sizeof eval, "eval loss %.4f -> %.4f", summary.first_eval_loss, summary.last_eval_loss);
  } else if (!std::isnan(summary.last_eval_loss)) {
    std::snprintf(eval, sizeof eval, "eval loss %.4f", summary.last_eval_loss);
  }
  std::string written = summary.adapter_dir.empty() ? "" : "; adapter in " + summary.adapter_dir;
  for (const auto& path : summary.exports) written += "; " + path;
  std::printf("done: %lld steps in %.1f s; %s%s\n", static_cast<long long>(summary.steps), summary.seconds, eval,
              written.c_str());
  return 0;
}

}  // namespace qtrain::tools
