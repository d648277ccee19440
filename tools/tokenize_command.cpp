// qtrain tokenize: JSONL {"text": ...} on stdin -> {"ids": [...]} on stdout (or the inverse with
// --decode); or, with --out FILE.bin, a whole dataset (any data.format) into an llm.c token file.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <limits>

#include "data/dataset.h"
#include "data/jsonl.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/formats/hf_hub_cache.h"
#include "trainer/base/file_system.h"
#include "trainer/recipe/recipe.h"
#include "trainer/recipe/recipe_data.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

// Every sample of the recipe's training data, whole (never cut to max_seq_len, never packed),
// one after another: a token file keeps documents, and the reader cuts them at each BOS.
int write_dataset_tokens(const trainer::Recipe& recipe, const std::string& out_path) {
  const auto start = std::chrono::steady_clock::now();
  const auto tokenizer = data::Tokenizer::from_model_dir(recipe.model.path);
  auto options = trainer::data_options(recipe);
  if (options.records.format == "tokens") throw Error(ErrorCode::kUsage, "data.format is already tokens: nothing to tokenize");
  options.max_seq_len = std::numeric_limits<int32_t>::max();
  options.pack = false;
  if (recipe.data.train.empty()) throw Error(ErrorCode::kUsage, "no data to tokenize: give --data FILE or set data.train in the recipe");
  const auto dataset = data::load_dataset(recipe.data.train, options, tokenizer, recipe.model.path);
  std::vector<int64_t> tokens;
  tokens.reserve(static_cast<size_t>(dataset.stats.tokens));
  for (const auto& example : dataset.examples) {
    tokens.insert(tokens.end(), example.input_ids.begin(), example.input_ids.end());
  }
  trainer::write_file_atomically(out_path, data::encode_token_file(tokens, tokenizer.vocab_size()));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("tokenize: %s\n  -> %s: %zu tokens (%.0f tokens/s, %.2f s)\n", data::describe(dataset.stats).c_str(),
              out_path.c_str(), tokens.size(), static_cast<double>(tokens.size()) / std::max(seconds, 1e-9), seconds);
  return 0;
}

int tokenize_stream(const std::string& model_dir, bool decode, bool add_special, bool skip_special) {
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

}  // namespace

int run_tokenize(const Arguments& arguments) {
  std::string model_dir, out_path, recipe_path, data_path, format;
  std::vector<std::string> overrides;
  po::options_description options("tokenize options");
  options.add_options()
      ("model", po::value(&model_dir), "model directory with tokenizer.json (or the recipe's model.path)")
      ("no-special", po::bool_switch(), "no special tokens (transformers' add_special_tokens=False)")
      ("decode", po::bool_switch(), "read {\"ids\": [...]} lines and write {\"text\": ...}")
      ("skip-special", po::bool_switch(), "with --decode: leave special tokens out of the text")
      ("out", po::value(&out_path), "write a dataset into this llm.c .bin token file instead of using stdin/stdout")
      ("recipe", po::value(&recipe_path), "with --out: the recipe whose data.train (and data section) to tokenize")
      ("set", po::value(&overrides)->composing(), "with --out: override a recipe key (repeatable)")
      ("data", po::value(&data_path), "with --out: the data file or directory (data.train)")
      ("format", po::value(&format), "with --out: text, instruct or chat (data.format)");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain tokenize --model DIR [--no-special | --decode] < in.jsonl > out.jsonl\n"
                          "       qtrain tokenize --out FILE.bin (--recipe R | --model DIR --data PATH) [--format F]",
                          options, arguments, values)) {
    return 0;
  }
  model_dir = trainer::resolve_model_path(model_dir, "--model");  // a folder, or ORG/NAME in the HF cache
  if (out_path.empty()) {
    if (model_dir.empty()) throw Error(ErrorCode::kUsage, "--model DIR is required (or --out FILE.bin to tokenize a dataset)");
    if (!recipe_path.empty() || !data_path.empty() || !format.empty() || !overrides.empty()) {
      throw Error(ErrorCode::kUsage, "--recipe, --data, --format and --set go with --out FILE.bin");
    }
    return tokenize_stream(model_dir, values["decode"].as<bool>(), !values["no-special"].as<bool>(),
                           values["skip-special"].as<bool>());
  }
  if (!model_dir.empty()) overrides.push_back("model.path=" + model_dir);
  if (!data_path.empty()) overrides.push_back("data.train=" + data_path);
  if (!format.empty()) overrides.push_back("data.format=" + format);
  const auto recipe = trainer::load_recipe(recipe_path, overrides);
  if (recipe.model.path.empty()) throw Error(ErrorCode::kUsage, "the tokenizer's model directory is not set: give --model DIR");
  return write_dataset_tokens(recipe, out_path);
}

}  // namespace qtrain::tools
