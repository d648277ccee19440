// Bucketed gradient reduction between ranks run as threads of this process over Gloo.
#include <gtest/gtest.h>

#include <future>

#include "support.h"
#include "trainer/dist/gradient_buckets.h"
#include "trainer/dist/process_group.h"

namespace qtrain::trainer {
namespace {

// Rank `rank` of `world_size` ranks over Gloo on this machine's `port`, as threads of this process.
std::unique_ptr<ProcessGroup> gloo_rank(int64_t rank, int64_t world_size, int64_t port, int64_t timeout_seconds = 30) {
  LaunchEnvironment environment;
  environment.rank = rank;
  environment.world_size = world_size;
  environment.local_world_size = world_size;
  environment.master_port = port;
  ProcessGroupOptions options;
  options.backend = "gloo";
  options.timeout = std::chrono::seconds(timeout_seconds);
  return std::make_unique<ProcessGroup>(environment, torch::kCPU, options);
}

struct RankResult {
  std::vector<torch::Tensor> local_gradients;  // what this rank's data alone gives
  std::vector<torch::Tensor> reduced_gradients;
  size_t buckets = 0;
};

// Three parameters of different sizes; `micro_batches` backward passes, the last one armed.
RankResult run_rank(int64_t rank, int64_t world_size, int64_t port, int64_t bucket_bytes, int micro_batches,
                    bool leave_one_unused, GradientReduction reduction = GradientReduction::kAllReduce) {
  const auto group_of_rank = gloo_rank(rank, world_size, port);
  auto& group = *group_of_rank;

  torch::manual_seed(0);  // the same parameters on every rank
  std::vector<torch::Tensor> parameters{torch::randn({64, 32}).requires_grad_(), torch::randn({32}).requires_grad_(),
                                        torch::randn({32, 16}).requires_grad_()};
  GradientBuckets buckets(parameters, group, bucket_bytes, reduction);
  torch::manual_seed(100 + rank);  // different data on each rank
  std::vector<torch::Tensor> inputs;
  for (int index = 0; index < micro_batches; ++index) inputs.push_back(torch::randn({8, 64}));
  auto loss_of = [&](const torch::Tensor& input) {
    auto hidden = torch::tanh(input.matmul(parameters[0]) + parameters[1]);
    return leave_one_unused ? hidden.pow(2).sum() : hidden.matmul(parameters[2]).pow(2).sum();
  };
  RankResult result;
  // The local gradients first, without communication.
  for (const auto& input : inputs) loss_of(input).backward();
  for (auto& parameter : parameters) {
    result.local_gradients.push_back(parameter.grad().defined() ? parameter.grad().clone()
                                                                : torch::zeros_like(parameter));
    parameter.mutable_grad() = torch::Tensor();
  }
  for (int index = 0; index < micro_batches; ++index) {
    if (index + 1 == micro_batches) buckets.arm();
    loss_of(inputs[index]).backward();
  }
  buckets.finish();
  for (auto& parameter : parameters) result.reduced_gradients.push_back(parameter.grad().clone());
  result.buckets = buckets.bucket_count();
  return result;
}

void expect_sums(int64_t bucket_bytes, int micro_batches, bool leave_one_unused, size_t expected_buckets) {
  const int64_t port = testing::free_port();
  auto other = std::async(std::launch::async, [&] { return run_rank(1, 2, port, bucket_bytes, micro_batches, leave_one_unused); });
  const auto zero = run_rank(0, 2, port, bucket_bytes, micro_batches, leave_one_unused);
  const auto one = other.get();
  EXPECT_EQ(zero.buckets, expected_buckets);
  for (size_t index = 0; index < zero.local_gradients.size(); ++index) {
    const auto expected = zero.local_gradients[index] + one.local_gradients[index];
    EXPECT_TRUE(torch::allclose(zero.reduced_gradients[index], expected, 1e-6, 1e-6)) << "parameter " << index;
    EXPECT_TRUE(torch::equal(zero.reduced_gradients[index], one.reduced_gradients[index])) << "parameter " << index;
  }
}

TEST(GradientBuckets, SumsEveryGradientOverTheRanksInOneBucket) { expect_sums(25 << 20, 1, false, 1); }

TEST(GradientBuckets, SumsEveryGradientOverTheRanksInSeveralBuckets) {
  // 32x16 and 32 floats fit 4 KiB together; 64x32 takes a bucket of its own.
  expect_sums(4096, 1, false, 2);
}

TEST(GradientBuckets, AccumulatesLocallyUntilTheArmedBackward) { expect_sums(4096, 3, false, 2); }

TEST(GradientBuckets, AParameterWithoutAGradientCountsAsZero) { expect_sums(4096, 2, true, 2); }

// dist.reduce: ordered on 4 ranks: every rank holds ((g0 + g1) + g2) + g3 bit for bit, what one
// process accumulating the four ranks' micro-batches in turn holds.
TEST(GradientBuckets, OrderedReductionAddsTheRanksInRankOrderBitForBit) {
  constexpr int64_t kRanks = 4;
  const int64_t port = testing::free_port();
  std::vector<std::future<RankResult>> others;
  for (int64_t rank = 1; rank < kRanks; ++rank) {
    others.push_back(std::async(std::launch::async, [rank, port] {
      return run_rank(rank, kRanks, port, 4096, 1, false, GradientReduction::kOrdered);
    }));
  }
  std::vector<RankResult> results{run_rank(0, kRanks, port, 4096, 1, false, GradientReduction::kOrdered)};
  for (auto& other : others) results.push_back(other.get());
  for (size_t index = 0; index < results[0].local_gradients.size(); ++index) {
    auto in_turn = results[0].local_gradients[index].clone();
    for (int64_t rank = 1; rank < kRanks; ++rank) in_turn.add_(results[rank].local_gradients[index]);
    // The data tells the orders apart: a pairwise tree, as a ring or tree all-reduce may add, differs.
    const auto pairwise = (results[0].local_gradients[index] + results[1].local_gradients[index]) +
                          (results[2].local_gradients[index] + results[3].local_gradients[index]);
    if (index == 0) EXPECT_FALSE(torch::equal(in_turn, pairwise)) << "the test's gradients cannot tell the orders apart";
    for (int64_t rank = 0; rank < kRanks; ++rank) {
      EXPECT_TRUE(torch::equal(results[rank].reduced_gradients[index], in_turn)) << "parameter " << index << ", rank " << rank;
    }
  }
}

// Each rank's one number on every rank, in rank order (the ranks' free device memory, which the
// memory plan takes the least of).
TEST(ProcessGroup, EveryRankGetsEachRanksValueInRankOrder) {
  constexpr int64_t kRanks = 3;
  const int64_t port = testing::free_port();
  const auto run = [port](int64_t rank) {
    return gloo_rank(rank, kRanks, port)->every_rank(1e9 + 7.5 * static_cast<double>(rank), "a test's values");
  };
  std::vector<std::future<std::vector<double>>> others;
  for (int64_t rank = 1; rank < kRanks; ++rank) others.push_back(std::async(std::launch::async, run, rank));
  std::vector<std::vector<double>> seen{run(0)};
  for (auto& other : others) seen.push_back(other.get());
  for (const auto& values : seen) EXPECT_EQ(values, (std::vector<double>{1e9, 1e9 + 7.5, 1e9 + 15.0}));
}

TEST(ProcessGroup, ASecondRankThatNeverComesIsAnErrorNamingTheAddress) {
  try {
    gloo_rank(0, 2, testing::free_port(), 2);
    FAIL() << "expected the rendezvous to time out";
  } catch (const std::exception& error) {
    EXPECT_NE(std::string(error.what()).find("rendezvous at 127.0.0.1:"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::trainer
