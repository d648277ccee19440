// qtrain: quantization-aware training and QLoRA fine-tuning of Llama models.
//   qtrain [train] --recipe FILE [--set key=value ...] [--print-recipe]
//   qtrain eval | generate | tokenize | data | inspect | export | quantize | bench | plot ... (qtrain SUBCOMMAND --help)
//   --debug (anywhere): errors keep their full text and LibTorch's stack traces.
#include <algorithm>
#include <iostream>
#include <map>

#include "tools/commands.h"
#include "tools/fatal_errors.h"
#include "trainer/base/cpu_threads.h"

namespace po = boost::program_options;

namespace qtrain::tools {

bool parse_command_line(const std::string& usage, const po::options_description& options, const Arguments& arguments,
                        po::variables_map& values, const po::positional_options_description* positional) {
  po::options_description with_help(options);
  with_help.add_options()("help,h", "show this help");
  po::command_line_parser parser(arguments);
  parser.options(with_help);
  if (positional) parser.positional(*positional);
  po::store(parser.run(), values);
  if (values.count("help")) {
    std::cout << usage << "\n\n" << with_help << "\n";
    return false;
  }
  po::notify(values);
  return true;
}

namespace {

struct Command {
  int (*run)(const Arguments&);
  const char* summary;
};

const std::map<std::string, Command>& commands() {
  static const std::map<std::string, Command> table = {
      {"train", {run_train, "train from a recipe (the default command)"}},
      {"eval", {run_eval, "loss and perplexity of a model (and adapter) on JSONL data"}},
      {"tokenize", {run_tokenize, "text to token ids (JSONL on stdin, or a dataset into an llm.c .bin file)"}},
      {"data", {run_data, "the first training examples as the model sees them (masked spans marked)"}},
      {"inspect", {run_inspect, "architecture, sizes and memory needs of a Hugging Face model"}},
      {"bench", {run_bench, "training tokens/s and peak memory of a random Llama-, Qwen-, Mistral-, Gemma- or Phi-3-shaped model"}},
      {"generate", {run_generate, "text from a model (and adapter): greedy or sampled, streamed, with a KV cache"}},
      {"plot", {run_plot, "the loss and learning-rate curves of one or more runs as an SVG picture"}},
      {"quantize", {run_quantize, "post-training quantization with a QAT recipe's scheme (PTQ), exported"}},
      {"export", {run_export, "a run's PEFT adapter, or its model with the adapter merged, into a new directory"}},
  };
  return table;
}

void print_overview() {
  std::cout << "qtrain: QLoRA and quantization-aware training for Llama, Mistral, Qwen, Gemma and Phi-3 models\n\n"
               "usage: qtrain [train] --recipe FILE [--set key=value ...] [--print-recipe]\n"
               "       qtrain COMMAND [options]     (qtrain COMMAND --help lists its options)\n\ncommands:\n";
  for (const auto& [name, command] : commands()) {
    std::cout << "  " << name << std::string(10 - name.size(), ' ') << command.summary << "\n";
  }
}

}  // namespace
}  // namespace qtrain::tools

int main(int argc, char** argv) {
  using namespace qtrain::tools;
  Arguments arguments(argv + 1, argv + argc);
  const auto debug_flag = std::remove(arguments.begin(), arguments.end(), std::string("--debug"));
  const bool debug = debug_flag != arguments.end();
  arguments.erase(debug_flag, arguments.end());
  std::string name = "train";
  if (arguments.empty() || arguments[0] == "--help" || arguments[0] == "-h") {
    print_overview();
    return arguments.empty() ? 2 : 0;
  }
  if (arguments[0].rfind("-", 0) != 0) {
    name = arguments[0];
    arguments.erase(arguments.begin());
  }
  const auto found = commands().find(name);
  if (found == commands().end()) {
    std::string names;
    for (const auto& [known, command] : commands()) names += (names.empty() ? "" : ", ") + known;
    std::cerr << "qtrain: error [QT-USAGE]: unknown command '" << name << "' (commands: " << names
              << "; see qtrain --help)\n";
    return kExitUserError;
  }
  install_fatal_error_handlers(name, debug);
  qtrain::trainer::set_default_cpu_threads();
  try {
    return found->second.run(arguments);
  } catch (...) {
    return report_error(name, std::current_exception(), debug);
  }
}
