// Faults a long run meets: a disk that fills while a checkpoint is written. (Kills at random
// moments: cli_test.cpp; killed ranks: distributed_test.cpp; 50 kills, tmpfs, torchrun restarts
// and NaN storms: tools/faults.py, whose figures docs/RELIABILITY.md records.)
#include <gtest/gtest.h>

#include <algorithm>

#include "support.h"
#include "trainer/training_checkpoint.h"

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

}  // namespace
}  // namespace qtrain
