// Faults a long run meets: a disk that fills while a checkpoint is written; a rank killed under
// torchrun --max-restarts and NaN storms (both through tools/faults.py). (Kills at random
// moments: cli_test.cpp; killed ranks without torchrun: distributed_test.cpp; 50 kills and a
// full tmpfs: tools/faults.py's full run, whose figures docs/RELIABILITY.md records.)
#include <gtest/gtest.h>

#include <algorithm>

#include "support.h"
#include "trainer/formats/training_checkpoint.h"

namespace qtrain {
namespace {

using testing::run_command;

std::string short_run(const std::string& run_dir, int steps) {
  return testing::qtrain_binary() + " --recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml" +
         " --set data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl --set data.eval=" +
         " --set data.max_seq_len=32 --set checkpoint.every=1 --set log.every=1 --set train.steps=" +
         std::to_string(steps) + " --set train.output_dir=" + run_dir;
}

TEST(Faults, AFullDiskDuringACheckpointIsOneErrorAndKeepsThePreviousCheckpoint) {
  testing::TempDir run;
  ASSERT_EQ(run_command(short_run(run.path(), 2) + " 2>&1").status, 0);
  const auto before = trainer::newest_valid_checkpoint(run.path());
  ASSERT_TRUE(before.has_value());
  // 64 KiB per file: every checkpoint file larger than that fails to write (EFBIG).
  const auto full = run_command("bash -c 'ulimit -f 64; " + short_run(run.path(), 4) + " --resume auto' 2>&1");
  EXPECT_NE(full.status, 0) << full.output;
  EXPECT_EQ(full.output.find("terminate called"), std::string::npos) << full.output;
  // One error line, however many progress lines came before it.
  size_t error_lines = 0;
  for (size_t at = full.output.find("error ["); at != std::string::npos; at = full.output.find("error [", at + 1)) {
    ++error_lines;
  }
  EXPECT_EQ(error_lines, 1u) << full.output;
  const auto after = trainer::newest_valid_checkpoint(run.path());
  ASSERT_TRUE(after.has_value()) << full.output;
  EXPECT_EQ(*after, *before);
  for (const auto& checkpoint : trainer::list_training_checkpoints(run.path())) {
    EXPECT_NO_THROW(trainer::verify_training_checkpoint(checkpoint)) << checkpoint;
  }
  const auto resumed = run_command(short_run(run.path(), 3) + " --resume auto 2>&1");
  EXPECT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resume: continuing from"), std::string::npos) << resumed.output;
}

// tools/faults.py checks each promise and exits non-zero when one is broken; its lines say which.
testing::CommandResult run_faults(const std::string& faults, const std::string& python, const std::string& device = "cpu") {
  testing::TempDir work;
  return run_command("OMP_NUM_THREADS=1 QTRAIN_PYTHON='" + python + "' '" + python + "' " + testing::source_dir() +
                     "/tools/faults.py --device " + device + " --qtrain " + testing::qtrain_binary() + " --work " +
                     work.path() + " " + faults + " 2>&1");
}

// A torchrun fault of tools/faults.py on `device` (cuda: one GPU per rank, NCCL), whose summary
// line must start with `promise`.
void expect_torchrun_fault_handled(const std::string& fault, const std::string& device, const std::string& promise) {
  if (device == "cuda" && torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 CUDA GPUs";
  if (!testing::python_has("torch.distributed.run")) GTEST_SKIP() << "no torch in " << testing::python();
  const auto result = run_faults(fault, testing::python(), device);
  EXPECT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("ok   " + promise), std::string::npos) << result.output;
}

TEST(Faults, ARankKilledUnderTorchrunEndsTheOthersAndTheRestartResumes) {
  expect_torchrun_fault_handled("torchrun", "cpu", "torchrun rank kill: 1 injected, 1 handled");
}

TEST(Faults, ARankKilledUnderTorchrunOverNcclEndsTheOthersAndTheRestartResumes) {
  expect_torchrun_fault_handled("torchrun", "cuda", "torchrun rank kill: 1 injected, 1 handled");
}

TEST(Faults, AStopSignalToOneRankStopsEveryRankAfterTheSameStep) {
  expect_torchrun_fault_handled("stop", "cpu", "stop signal to one rank: 1 injected, 1 handled");
}

TEST(Faults, AStopSignalToOneGpuRankStopsEveryRankAfterTheSameStep) {
  expect_torchrun_fault_handled("stop", "cuda", "stop signal to one rank: 1 injected, 1 handled");
}

TEST(Faults, ANanStormStopsWithTheDocumentedMessage) {
  const auto result = run_faults("nan", "python3");
  EXPECT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("ok   NaN storm: 2 injected, 2 handled"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace qtrain
