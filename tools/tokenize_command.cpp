// qtrain tokenize: JSONL {"text": ...} on stdin -> {"ids": [...]} on stdout, or the inverse.
#include <iostream>

#include "data/jsonl.h"
#include "data/tokenizer.h"
#include "kernels/error.h"
#include "tools/commands.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_tokenize(const Arguments& arguments) {
  std::string model_dir;
  po::options_description options("tokenize options");
  options.add_options()
      ("model", po::value(&model_dir)->required(), "model directory with tokenizer.json")
      ("no-special", po::bool_switch(), "no special tokens (transformers' add_special_tokens=False)")
      ("decode", po::bool_switch(), "read {\"ids\": [...]} lines and write {\"text\": ...}")
      ("skip-special", po::bool_switch(), "with --decode: leave special tokens out of the text");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain tokenize --model DIR [--no-special | --decode] < in.jsonl > out.jsonl",
                          options, arguments, values)) {
    return 0;
  }
  const bool decode = values["decode"].as<bool>();
  const bool add_special = !values["no-special"].as<bool>();
  const bool skip_special = values["skip-special"].as<bool>();
  const auto tokenizer = data::Tokenizer::from_model_dir(model_dir);
  const int64_t vocab_size = tokenizer.vocab_size();
  std::ios::sync_with_stdio(false);
  data::for_each_jsonl_record(std::cin, "<stdin>", [&](const data::JsonlRecord& record) {
    if (!decode) {
      std::cout << nlohmann::json{{"ids", tokenizer.encode(record.string_field("text"), add_special)}}.dump() << "\n";
      return;
    }
    auto ids = record.value.find("ids");
    if (ids == record.value.end() || !ids->is_array()) record.fail("expected an \"ids\" list of token ids");
    std::vector<int64_t> tokens;
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size) {
        record.fail("\"ids\" holds " + id.dump() + ", expected token ids in [0, " + std::to_string(vocab_size) + ")");
      }
      tokens.push_back(id.get<int64_t>());
    }
    std::cout << nlohmann::json{{"text", tokenizer.decode(tokens, skip_special)}}.dump(-1, ' ', false,
                                                                                        nlohmann::json::error_handler_t::replace)
              << "\n";
  });
  return 0;
}

}  // namespace qtrain::tools
