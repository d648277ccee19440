// qtrain data --recipe FILE [-n N] [--json]: the first training examples as the model will
// see them, in training order: the text with the spans the loss ignores marked (a preference
// pair's chosen and rejected sequences one after the other), or the ids and labels as JSON.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "data/batching.h"
#include "tools/commands.h"
#include "trainer/objectives/objectives.h"
#include "trainer/recipe/recipe.h"
#include "trainer/recipe/recipe_data.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

// The example's text, sample by sample, with the tokens that are not labels inside [[ ]].
std::string marked_text(const data::Example& example, const data::Tokenizer& tokenizer, bool pairs) {
  const std::vector<int64_t> whole = {example.size()};
  const auto& lengths = example.sample_lengths.empty() ? whole : example.sample_lengths;
  std::string text;
  size_t position = 0;
  for (size_t sample = 0; sample < lengths.size(); ++sample) {
    if (pairs) {
      text += std::string(sample == 0 ? "" : "\n") + (sample == 0 ? "[chosen, " : "[rejected, ") +
              std::to_string(lengths[sample]) + " tokens]\n";
    } else if (lengths.size() > 1) {
      text += "\n[sample " + std::to_string(sample + 1) + " of " + std::to_string(lengths.size()) + ", " +
              std::to_string(lengths[sample]) + " tokens]\n";
    }
    const size_t end = position + static_cast<size_t>(lengths[sample]);
    while (position < end) {
      const bool learned = example.labels[position] != data::kIgnoreLabel;
      std::vector<int64_t> span;
      for (; position < end && (example.labels[position] != data::kIgnoreLabel) == learned; ++position) {
        span.push_back(example.input_ids[position]);
      }
      const std::string decoded = tokenizer.decode(span);
      text += learned ? decoded : "[[" + decoded + "]]";
    }
  }
  return text;
}

}  // namespace

int run_data(const Arguments& arguments) {
  std::string recipe_path;
  std::vector<std::string> overrides;
  int64_t count = 0;
  po::options_description options("data options");
  options.add_options()
      ("recipe", po::value(&recipe_path)->required(), "YAML recipe whose data section to show")
      ("set", po::value(&overrides)->composing(), "override a recipe key (repeatable)")
      ("count,n", po::value(&count)->default_value(3), "how many examples")
      ("json", po::bool_switch(), "one {\"input_ids\", \"labels\"} object per line instead of text");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain data --recipe FILE [--set key=value ...] [-n N] [--json]", options,
                          arguments, values)) {
    return 0;
  }
  const bool as_json = values["json"].as<bool>();
  const auto recipe = trainer::load_recipe(recipe_path, overrides);
  const bool pairs = trainer::find_objective(recipe.train.objective).pairs;
  const auto tokenizer = data::Tokenizer::from_model_dir(recipe.model.path);
  auto dataset = trainer::load_training_examples(recipe, tokenizer);
  // The log goes to stderr with --json, so that stdout is JSON Lines.
  std::fprintf(as_json ? stderr : stdout, "data: train %s\n", data::describe(dataset.stats).c_str());
  for (const auto& message : dataset.stats.bad_record_messages) {
    std::fprintf(as_json ? stderr : stdout, "  skipped: %s\n", message.c_str());
  }
  // Every example once at most: the first epoch's order.
  count = std::min<int64_t>(count, static_cast<int64_t>(dataset.examples.size()));
  data::BatchStream stream(std::move(dataset.examples), trainer::batch_stream_options(recipe, tokenizer));
  if (!as_json) std::printf("text inside [[ ]] takes no part in the loss\n");
  for (int64_t shown = 0; shown < count;) {
    const auto state = stream.state();
    const auto rows = stream.next_rows();
    for (size_t row = 0; row < rows.size() && shown < count; ++row, ++shown) {
      const data::Example& example = *rows[row];
      if (as_json) {
        nlohmann::json line = {{"input_ids", example.input_ids}, {"labels", example.labels}};
        if (!example.sample_lengths.empty()) line["sample_lengths"] = example.sample_lengths;
        std::cout << line.dump() << "\n";
        continue;
      }
      std::printf("\n=== example %lld (epoch %lld, batch %lld, row %zu): %lld tokens, %lld learned ===\n%s\n",
                  static_cast<long long>(shown + 1), static_cast<long long>(state.epoch),
                  static_cast<long long>(state.batch_in_epoch), row, static_cast<long long>(example.size()),
                  static_cast<long long>(example.predicted_tokens()), marked_text(example, tokenizer, pairs).c_str());
    }
  }
  return 0;
}

}  // namespace qtrain::tools
