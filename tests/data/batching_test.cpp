// The training order: collation, sharding across ranks, resumable state, and the
// prefetching loader handing out exactly the batches of the plain stream.
#include "data/batching.h"

#include <gtest/gtest.h>

#include <set>

#include "data/loader.h"
#include "kernels/error.h"

namespace qtrain::data {
namespace {

// Example i holds tokens {i, i, ...} of length 2 + i % 3, so batches show which examples they hold.
std::vector<Example> numbered_examples(int64_t count) {
  std::vector<Example> examples;
  for (int64_t i = 0; i < count; ++i) {
    Example example;
    example.input_ids.assign(static_cast<size_t>(2 + i % 3), i);
    example.labels = example.input_ids;
    examples.push_back(example);
  }
  return examples;
}

std::vector<int64_t> first_tokens(const Batch& batch) {
  std::vector<int64_t> ids;
  for (int64_t row = 0; row < batch.input_ids.size(0); ++row) ids.push_back(batch.input_ids[row][0].item<int64_t>());
  return ids;
}

bool same_batch(const Batch& a, const Batch& b) {
  return torch::equal(a.input_ids, b.input_ids) && torch::equal(a.labels, b.labels) &&
         a.predicted_tokens == b.predicted_tokens;
}

TEST(Collate, PadsRightAndCountsOnlyPredictedLabels) {
  Example a{{5, 6, 7}, {kIgnoreLabel, kIgnoreLabel, 7}, {}};
  Example b{{8}, {8}, {}};
  const auto batch = collate({&a, &b}, /*pad_id=*/3);
  EXPECT_TRUE(torch::equal(batch.input_ids, torch::tensor({5, 6, 7, 8, 3, 3}, torch::kInt64).view({2, 3})));
  EXPECT_TRUE(torch::equal(batch.labels, torch::tensor({-100, -100, 7, 8, -100, -100}, torch::kInt64).view({2, 3})));
  EXPECT_EQ(batch.input_tokens, 4);
  EXPECT_EQ(batch.predicted_tokens, 1);  // b's only label is at position 0: nothing predicts it
  EXPECT_FALSE(batch.position_ids.defined());
}

TEST(Collate, PackedRowsRestartPositionsAndNumberTheirSamples) {
  Example packed{{1, 2, 3, 4, 5}, {kIgnoreLabel, 2, kIgnoreLabel, 4, 5}, {2, 3}};
  const auto batch = collate({&packed}, 0);
  EXPECT_TRUE(torch::equal(batch.position_ids, torch::tensor({0, 1, 0, 1, 2}, torch::kInt64).view({1, 5})));
  EXPECT_TRUE(torch::equal(batch.sample_ids, torch::tensor({0, 0, 1, 1, 1}, torch::kInt64).view({1, 5})));
}

// Attention runs the leading rows that are one full-length sample as one causal block, so a packed
// batch puts those first and keeps the order otherwise; an unpacked batch keeps its order.
TEST(Collate, PackedRowsOfOneFullSampleComeFirstInTheirOrder) {
  Example split{{1, 2, 3}, {kIgnoreLabel, 2, 3}, {1, 2}};
  Example whole_a{{4, 5, 6}, {kIgnoreLabel, 5, 6}, {3}};
  Example short_one{{7, 8}, {kIgnoreLabel, 8}, {2}};
  Example whole_b{{9, 10, 11}, {kIgnoreLabel, 10, 11}, {3}};
  const auto batch = collate({&split, &whole_a, &short_one, &whole_b}, 0);
  EXPECT_EQ(first_tokens(batch), (std::vector<int64_t>{4, 9, 1, 7}));
  EXPECT_TRUE(torch::equal(batch.sample_ids, torch::tensor({0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, -1}, torch::kInt64).view({4, 3})));
  EXPECT_EQ(batch.predicted_tokens, 7);
  Example a{{1, 2}, {1, 2}, {}}, b{{3, 4, 5}, {3, 4, 5}, {}};
  EXPECT_EQ(first_tokens(collate({&a, &b}, 0)), (std::vector<int64_t>{1, 3}));
}

TEST(BatchStream, RanksSeeDisjointExamplesAndTogetherTheWholeEpoch) {
  for (const int64_t world_size : {1, 2, 3}) {
    std::multiset<int64_t> seen;
    for (int64_t rank = 0; rank < world_size; ++rank) {
      BatchStreamOptions options;
      options.batch_size = 2;
      options.rank = rank;
      options.world_size = world_size;
      BatchStream stream(numbered_examples(24), options);
      ASSERT_EQ(stream.batches_per_epoch(), 12 / world_size);
      for (int64_t batch = 0; batch < stream.batches_per_epoch(); ++batch) {
        for (const int64_t id : first_tokens(stream.next())) seen.insert(id);
      }
    }
    ASSERT_EQ(seen.size(), 24u) << world_size << " ranks";
    for (int64_t id = 0; id < 24; ++id) EXPECT_EQ(seen.count(id), 1u) << "example " << id << ", " << world_size;
  }
}

TEST(BatchStream, EpochsAreSeededPermutations) {
  BatchStreamOptions options;
  options.batch_size = 4;
  BatchStream a(numbered_examples(16), options), b(numbered_examples(16), options);
  std::vector<int64_t> epoch0, epoch1;
  for (int i = 0; i < 4; ++i) {
    const auto batch = a.next();
    EXPECT_TRUE(same_batch(batch, b.next()));
    for (auto id : first_tokens(batch)) epoch0.push_back(id);
  }
  for (int i = 0; i < 4; ++i) {
    for (auto id : first_tokens(a.next())) epoch1.push_back(id);
  }
  EXPECT_NE(epoch0, epoch1);
  std::sort(epoch0.begin(), epoch0.end());
  std::sort(epoch1.begin(), epoch1.end());
  EXPECT_EQ(epoch0, epoch1);
}

TEST(BatchStream, StateRoundTripsThroughJsonAndResumesExactly) {
  BatchStreamOptions options;
  options.batch_size = 3;
  options.seed = 7;
  BatchStream uninterrupted(numbered_examples(20), options);
  BatchStream stopped(numbered_examples(20), options);
  for (int i = 0; i < 8; ++i) {  // into the second epoch (6 batches per epoch)
    uninterrupted.next();
    stopped.next();
  }
  const auto saved = LoaderState::from_json(nlohmann::json::parse(stopped.state().to_json().dump()), "state.json");
  EXPECT_EQ(saved.epoch, 1);
  EXPECT_EQ(saved.batch_in_epoch, 2);
  BatchStream resumed(numbered_examples(20), options);
  resumed.restore(saved);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(same_batch(uninterrupted.next(), resumed.next())) << "batch " << i;
}

TEST(BatchStream, StateFromOtherDataOrSettingsIsRefused) {
  BatchStreamOptions options;
  options.batch_size = 2;
  const auto state = BatchStream(numbered_examples(10), options).state();
  EXPECT_THROW(BatchStream(numbered_examples(12), options).restore(state), Error);
  options.seed = 1;
  EXPECT_THROW(BatchStream(numbered_examples(10), options).restore(state), Error);
  EXPECT_THROW(LoaderState::from_json(nlohmann::json{{"epoch", 1}}, "state.json"), Error);
}

TEST(DataLoader, PrefetchingHandsOutTheStreamsBatchesAndResumes) {
  BatchStreamOptions options;
  options.batch_size = 2;
  BatchStream reference(numbered_examples(15), options);
  DataLoader loader(BatchStream(numbered_examples(15), options), /*prefetch_batches=*/3);
  LoaderState middle;
  for (int i = 0; i < 12; ++i) {
    EXPECT_TRUE(same_batch(reference.next(), loader.next())) << "batch " << i;
    if (i == 4) middle = loader.state();
  }
  EXPECT_EQ(loader.state().to_json(), reference.state().to_json());
  loader.restore(middle);
  BatchStream replay(numbered_examples(15), options);
  replay.restore(middle);
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(same_batch(replay.next(), loader.next())) << "after restore, batch " << i;
}

// A loader without drop_last: fewer examples than one batch train as one smaller batch, each
// rank taking an equal share.
TEST(BatchStream, FewerExamplesThanOneBatchMakeOneBatchOfThemAll) {
  BatchStreamOptions options;
  options.batch_size = 4;
  BatchStream alone(numbered_examples(2), options);
  EXPECT_EQ(alone.rows_per_batch(), 2);
  EXPECT_EQ(alone.batches_per_epoch(), 1);
  for (int epoch = 0; epoch < 3; ++epoch) {
    const auto ids = first_tokens(alone.next());
    EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()), (std::set<int64_t>{0, 1})) << "epoch " << epoch;
  }
  options.world_size = 2;
  std::multiset<int64_t> seen;
  for (int64_t rank = 0; rank < 2; ++rank) {
    options.rank = rank;
    BatchStream stream(numbered_examples(7), options);  // 3 per rank; the seventh waits for another epoch
    EXPECT_EQ(stream.rows_per_batch(), 3);
    for (const int64_t id : first_tokens(stream.next())) seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 6u);
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 6u);
}

TEST(BatchStream, FewerExamplesThanRanksIsAnErrorSayingSo) {
  BatchStreamOptions options;
  options.batch_size = 4;
  options.world_size = 3;
  try {
    BatchStream(numbered_examples(2), options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("fewer than the 3 ranks"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::data
