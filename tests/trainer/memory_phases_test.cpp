// bench --memory-phases' bookkeeping (trainer/base/memory_stats.h): each phase's peak is its own,
// phases met again keep their highest figures, in the order first met.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "optim/sgd.h"
#include "small_llama.h"
#include "trainer/base/memory_stats.h"
#include "trainer/loss_scaler.h"
#include "trainer/training_step.h"

namespace qtrain::trainer {
namespace {

std::vector<std::string> names(const MemoryPhases& phases) {
  std::vector<std::string> listed;
  for (const auto& phase : phases.phases()) listed.push_back(phase.name);
  return listed;
}

TEST(MemoryPhases, PhasesMetAgainKeepTheirPlaceInTheOrderFirstMet) {
  MemoryPhases phases{torch::Device(torch::kCPU)};
  for (int step = 0; step < 3; ++step) {
    phases.mark("forward");
    if (step == 1) phases.mark("loss");
    phases.mark("backward");
    phases.finish();
  }
  EXPECT_EQ(names(phases), (std::vector<std::string>{"forward", "backward", "loss"}));
  for (const auto& phase : phases.phases()) {
    EXPECT_GT(phase.at_start_bytes, 0) << phase.name;  // the process's resident set
    EXPECT_GE(phase.peak_bytes, phase.at_start_bytes) << phase.name;
  }
}

// On a GPU: 64 MiB allocated and freed within a phase count in its peak and in no other.
TEST(MemoryPhases, CudaEachPhasesPeakIsItsOwn) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto on_gpu = torch::TensorOptions().dtype(torch::kFloat32).device(cuda);
  constexpr double kMiB = 1024.0 * 1024.0;
  MemoryPhases phases(cuda);
  phases.mark("before");
  auto kept = torch::empty({1 << 20}, on_gpu);  // 4 MiB, freed in "after"
  phases.mark("during");
  for (int repeat = 0; repeat < 2; ++repeat) {
    const auto passing = torch::empty({16 << 20}, on_gpu);  // 64 MiB
  }
  phases.mark("after");
  kept = torch::Tensor();
  phases.finish();
  ASSERT_EQ(names(phases), (std::vector<std::string>{"before", "during", "after"}));
  const auto& before = phases.phases()[0];
  const auto& during = phases.phases()[1];
  const auto& after = phases.phases()[2];
  EXPECT_GE(before.peak_bytes - before.at_start_bytes, 4 * kMiB);
  EXPECT_LT(before.peak_bytes - before.at_start_bytes, 64 * kMiB);
  EXPECT_GE(during.peak_bytes - during.at_start_bytes, 64 * kMiB);
  EXPECT_GE(during.at_start_bytes, before.at_start_bytes + 4 * kMiB);
  EXPECT_LT(after.peak_bytes, during.peak_bytes - 32 * kMiB);
}

// A training step marks its phases where set_memory_phases asks it to, in its order, once for
// each micro-batch of a window.
TEST(MemoryPhases, ATrainingStepMarksForwardLossBackwardAndUpdate) {
  torch::manual_seed(3);
  LlamaForCausalLM model(testing::small_llama_options(32, 2), torch::kFloat32);
  auto trainable = model->parameters();
  optim::SgdOptions sgd;
  sgd.lr = 0.01;
  optim::Sgd optimizer(trainable, sgd);
  LossScaler scaler(false);
  TrainingStep step(*model, trainable, optimizer, scaler, TrainingStepOptions{});
  const std::vector<data::Batch> window = {testing::small_llama_batch(2, 9), testing::small_llama_batch(2, 9)};
  step.run(window, 0);  // no phases asked for
  MemoryPhases phases{torch::Device(torch::kCPU)};
  step.set_memory_phases(&phases);
  const auto result = step.run(window, 1);
  step.set_memory_phases(nullptr);
  phases.finish();
  step.run(window, 2);
  ASSERT_FALSE(result.skipped) << result.skip_reason;
  EXPECT_EQ(names(phases), (std::vector<std::string>{"forward", "loss", "backward", "update"}));
}

}  // namespace
}  // namespace qtrain::trainer
