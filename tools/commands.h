#pragma once
// The qtrain subcommands. Each parses its own options (Boost.Program_options), runs, and returns
// the process exit status; errors are thrown as qtrain::Error and reported by main().
#include <boost/program_options.hpp>
#include <string>
#include <vector>

namespace qtrain::tools {

using Arguments = std::vector<std::string>;

int run_train(const Arguments& arguments);
int run_eval(const Arguments& arguments);
int run_tokenize(const Arguments& arguments);
int run_data(const Arguments& arguments);
int run_inspect(const Arguments& arguments);
int run_export(const Arguments& arguments);
int run_generate(const Arguments& arguments);
int run_bench(const Arguments& arguments);
int run_quantize(const Arguments& arguments);
int run_plot(const Arguments& arguments);

// Parses `arguments` against `options`; `--help` prints usage and the options with their
// defaults. Returns false when help was printed (the command should exit 0).
bool parse_command_line(const std::string& usage, const boost::program_options::options_description& options,
                        const Arguments& arguments, boost::program_options::variables_map& values,
                        const boost::program_options::positional_options_description* positional = nullptr);

}  // namespace qtrain::tools
