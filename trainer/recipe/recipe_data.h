#pragma once
// The recipe's `data` section as the data library's options: one translation that training,
// `qtrain data` and `qtrain tokenize --recipe` share, so they all see the same examples.
#include "data/batching.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

data::DataOptions data_options(const Recipe& recipe);

// The training order: micro-batches of train.micro_batch_size, shuffled by train.seed.
data::BatchStreamOptions batch_stream_options(const Recipe& recipe, const data::Tokenizer& tokenizer,
                                              int64_t rank = 0, int64_t world_size = 1);

// Error when data.train is empty: Finetune checks it before loading a model, so that a
// missing key costs no minutes of loading.
void require_training_data(const Recipe& recipe);

// data.train's examples (require_training_data first).
data::Dataset load_training_examples(const Recipe& recipe, const data::Tokenizer& tokenizer);

// data.eval's examples, never packed and never mixed; empty when data.eval is not set.
data::Dataset load_eval_examples(const Recipe& recipe, const data::Tokenizer& tokenizer);

}  // namespace qtrain::trainer
