#include "trainer/recipe/recipe_data.h"

#include "kernels/error.h"

namespace qtrain::trainer {

data::DataOptions data_options(const Recipe& recipe) {
  data::DataOptions options;
  options.records.format = recipe.data.format;
  options.records.text_field = recipe.data.text_field;
  options.records.prompt_template = recipe.data.prompt_template;
  options.records.train_on_inputs = recipe.data.train_on_inputs;
  options.records.chat_template = recipe.data.chat_template;
  options.max_seq_len = recipe.data.max_seq_len;
  options.overlong = recipe.data.overlong;
  options.pack = recipe.data.pack;
  options.pack_strategy = recipe.data.pack_strategy;
  options.skip_bad_records = recipe.data.skip_bad_records;
  options.weights = recipe.data.weights;
  options.seed = static_cast<uint64_t>(recipe.train.seed);
  return options;
}

data::BatchStreamOptions batch_stream_options(const Recipe& recipe, const data::Tokenizer& tokenizer, int64_t rank,
                                              int64_t world_size) {
  data::BatchStreamOptions options;
  options.batch_size = recipe.train.micro_batch_size;
  options.shuffle = recipe.data.shuffle;
  options.seed = static_cast<uint64_t>(recipe.train.seed);
  options.pad_id = tokenizer.pad_id().value_or(0);
  options.rank = rank;
  options.world_size = world_size;
  return options;
}

void require_training_data(const Recipe& recipe) {
  if (recipe.data.train.empty()) {
    throw Error(ErrorCode::kRecipe, "data.train is not set: point it at a data file or a directory of shards (data.format " +
                recipe.data.format + ")");
  }
}

data::Dataset load_training_examples(const Recipe& recipe, const data::Tokenizer& tokenizer) {
  require_training_data(recipe);
  return data::load_dataset(recipe.data.train, data_options(recipe), tokenizer, recipe.model.path);
}

data::Dataset load_eval_examples(const Recipe& recipe, const data::Tokenizer& tokenizer) {
  if (recipe.data.eval.empty()) return {};
  auto options = data_options(recipe);
  options.pack = false;
  options.weights.clear();
  return data::load_dataset({recipe.data.eval}, options, tokenizer, recipe.model.path);
}

}  // namespace qtrain::trainer
