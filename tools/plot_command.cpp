// qtrain plot RUN [RUN ...] [--out FILE.svg]: the loss and learning-rate curves of one or more
// runs (their metrics.jsonl) as an SVG picture, at any time during or after training.
#include <cstdio>
#include <filesystem>
#include <set>

#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/logging/loss_curves.h"
#include "trainer/logging/metrics_file.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_plot(const Arguments& arguments) {
  std::vector<std::string> runs;
  std::string out;
  po::options_description options("plot options");
  options.add_options()
      ("run", po::value(&runs)->composing(), "a run directory (train.output_dir) or its metrics.jsonl; repeatable, or positional")
      ("out", po::value(&out)->default_value(""), "the SVG file (default: RUN/curves.svg for one run, curves.svg for several)");
  po::positional_options_description positional;
  positional.add("run", -1);
  po::variables_map values;
  if (!parse_command_line("usage: qtrain plot RUN [RUN ...] [--out FILE.svg]", options, arguments, values, &positional)) {
    return 0;
  }
  if (runs.empty()) throw Error(ErrorCode::kUsage, "give at least one run directory: qtrain plot RUN [RUN ...]");
  std::set<std::string> names;
  for (const auto& run : runs) names.insert(std::filesystem::path(run).lexically_normal().filename().string());
  std::vector<trainer::RunCurves> curves;
  for (const auto& run : runs) {
    // Each run is named by its directory, or by the path given where two directories share a name.
    const auto name = std::filesystem::path(run).lexically_normal().filename().string();
    curves.push_back(trainer::run_curves(trainer::read_metrics_file(run), names.size() == runs.size() ? name : run));
  }
  if (out.empty()) {
    out = runs.size() == 1 && std::filesystem::is_directory(runs.front()) ? runs.front() + "/curves.svg" : "curves.svg";
  }
  trainer::write_loss_curves_svg(curves, out);
  for (const auto& run : curves) {
    std::printf("%s: %zu train points, %zu eval points\n", run.label.c_str(), run.train_loss.size(), run.eval_loss.size());
  }
  std::printf("plot: %s\n", out.c_str());
  return 0;
}

}  // namespace qtrain::tools
