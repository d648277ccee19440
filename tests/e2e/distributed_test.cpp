// Data parallelism as users launch it: qtrain processes with torchrun's variables, over Gloo.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "support.h"
#include "trainer/formats/safetensors.h"

namespace qtrain {
namespace {

using testing::run_command;

// Four steps of the demo recipe without dropout (its masks are drawn per process, so they
// cannot match an accumulation run), micro-batch 2: qtrain's arguments. On cuda each rank takes
// the GPU of its LOCAL_RANK and the ranks reduce over NCCL.
std::string short_run_arguments(const std::string& run_dir, const std::string& device = "cpu",
                                const std::string& recipe = "demo_tiny.yaml") {
  return " --recipe " + testing::source_dir() + "/recipes/" + recipe +
         " --set train.steps=4 --set log.every=1 --set eval.max_batches=2 --set checkpoint.every=2" +
         " --set train.micro_batch_size=2 --set lora.dropout=0 --set train.device=" + device +
         " --set train.output_dir=" + run_dir;
}

// The same as a shell command, on one thread: every matmul then sums in the same order in
// every process, whatever the machine's cores.
std::string short_run(const std::string& run_dir, const std::string& device = "cpu",
                      const std::string& recipe = "demo_tiny.yaml") {
  return "OMP_NUM_THREADS=1 " + testing::qtrain_binary() + short_run_arguments(run_dir, device, recipe);
}

bool has_two_gpus() { return torch::cuda::device_count() >= 2; }

// Shell text that starts `world` ranks of `command` in the background, each with its log.
std::string launch_ranks(int world, const std::string& command, const std::string& logs, int port) {
  std::string script;
  for (int rank = 0; rank < world; ++rank) {
    script += "RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) + " LOCAL_RANK=" +
              std::to_string(rank) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
              " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " + command + " > " +
              logs + "/rank" + std::to_string(rank) + ".log 2>&1 & pid" + std::to_string(rank) + "=$!; ";
  }
  return script;
}

std::vector<std::pair<int64_t, double>> step_losses(const std::string& run_dir) {
  std::vector<std::pair<int64_t, double>> losses;
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("loss")) losses.emplace_back(record["step"].get<int64_t>(), record["loss"].get<double>());
  }
  return losses;
}

void expect_same_training(const std::string& accumulated, const std::string& parallel) {
  const auto expected = step_losses(accumulated);
  const auto got = step_losses(parallel);
  ASSERT_EQ(got.size(), 4u);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t index = 0; index < got.size(); ++index) {
    EXPECT_EQ(got[index].first, expected[index].first);
    EXPECT_NEAR(got[index].second, expected[index].second, 1e-6 * std::abs(expected[index].second))
        << "step " << got[index].first;
  }
  const auto want = trainer::SafetensorsFile::open(accumulated + "/adapter/adapter_model.safetensors");
  const auto have = trainer::SafetensorsFile::open(parallel + "/adapter/adapter_model.safetensors");
  ASSERT_EQ(want.names(), have.names());
  for (const auto& name : want.names()) {
    const auto expected_tensor = want.tensor(name).to(torch::kFloat64);
    const double scale = expected_tensor.abs().max().item<double>();
    EXPECT_LE((expected_tensor - have.tensor(name).to(torch::kFloat64)).abs().max().item<double>(), 1e-6 * scale)
        << name;
  }
}

// The contract of data parallelism: 2 ranks of micro-batch b take the same steps as 1 process
// accumulating 2 micro-batches of b over the same samples.
void expect_two_ranks_train_like_one_accumulating(const std::string& device, const std::string& backend,
                                                  const std::string& recipe = "demo_tiny.yaml",
                                                  const std::string& ranks_settings = "") {
  testing::TempDir runs;
  const auto one = run_command(short_run(runs.file("one"), device, recipe) + " --set train.grad_accum_steps=2 2>&1");
  ASSERT_EQ(one.status, 0) << one.output;
  const auto two = run_command("bash -c '" + launch_ranks(2, short_run(runs.file("two"), device, recipe) + ranks_settings,
                                                          runs.path(), testing::free_port()) +
                               "wait $pid0; s0=$?; wait $pid1; echo status=$s0,$?'");
  ASSERT_NE(two.output.find("status=0,0"), std::string::npos)
      << two.output << testing::read_text(runs.file("rank0.log")) << testing::read_text(runs.file("rank1.log"));
  expect_same_training(runs.file("one"), runs.file("two"));
  // Rank 0 reports; the others keep quiet unless something is wrong.
  EXPECT_NE(testing::read_text(runs.file("rank0.log")).find("dist: rank 0 of 2 (torchrun, " + backend), std::string::npos)
      << testing::read_text(runs.file("rank0.log"));
  EXPECT_EQ(testing::read_text(runs.file("rank1.log")), "");
}

TEST(Distributed, TwoRanksTrainLikeOneProcessAccumulatingTwoMicroBatches) {
  expect_two_ranks_train_like_one_accumulating("cpu", "gloo");
}

// The optimizer's state on the host, each layer's update in the next forward (trainer/deferred_update.h):
// the ranks' steps, evaluations, checkpoints and adapter are those of the update made at once.
TEST(Distributed, TwoRanksWithTheStateOnTheHostTrainLikeOneProcess) {
  expect_two_ranks_train_like_one_accumulating("cpu", "gloo", "demo_tiny.yaml", " --set train.optimizer_states_on_host=true");
}

// DPO: each micro-batch's loss is a mean over its pairs, and the step's the mean over the
// micro-batches of every rank, as TRL averages them.
TEST(Distributed, TwoRanksTrainDpoLikeOneProcessAccumulatingTwoMicroBatches) {
  expect_two_ranks_train_like_one_accumulating("cpu", "gloo", "demo_dpo_tiny.yaml");
}

TEST(Distributed, TwoGpuRanksOverNcclTrainLikeOneGpuAccumulatingTwoMicroBatches) {
  if (!has_two_gpus()) GTEST_SKIP() << "needs 2 CUDA GPUs";
  expect_two_ranks_train_like_one_accumulating("cuda", "nccl");
}

TEST(Distributed, TorchrunLaunchesTheSameTraining) {
  if (!testing::python_has("torch.distributed.run")) GTEST_SKIP() << "no torch in " << testing::python();
  testing::TempDir runs;
  const auto one = run_command(short_run(runs.file("one")) + " --set train.grad_accum_steps=2 2>&1");
  ASSERT_EQ(one.status, 0) << one.output;
  const auto two = run_command("OMP_NUM_THREADS=1 " + testing::python() +
                               " -m torch.distributed.run --nproc_per_node 2 --master_port " +
                               std::to_string(testing::free_port()) + " --no-python " + testing::qtrain_binary() +
                               short_run_arguments(runs.file("two")) + " 2>&1");
  ASSERT_EQ(two.status, 0) << two.output;
  expect_same_training(runs.file("one"), runs.file("two"));
}

// A rank killed mid-run: the survivor exits non-zero within dist.timeout_s, naming it.
void expect_survivor_names(int killed, int survivor, const std::string& device = "cpu") {
  testing::TempDir runs;
  const std::string command = short_run(runs.file("run"), device) + " --set train.steps=500 --set dist.timeout_s=60";
  const std::string survivor_log = runs.file("rank" + std::to_string(survivor) + ".log");
  const auto result = run_command(
      "bash -c '" + launch_ranks(2, command, runs.path(), testing::free_port()) + "for i in $(seq 1200); do grep -q \"^step 2/\" " +
      runs.file("rank0.log") + " && break; sleep 0.1; done; kill -9 $pid" + std::to_string(killed) +
      "; start=$(date +%s); wait $pid" + std::to_string(survivor) +
      "; echo status=$? seconds=$(( $(date +%s) - start ))' 2>/dev/null");
  const auto log = testing::read_text(survivor_log);
  EXPECT_EQ(result.output.find("status=0"), std::string::npos) << result.output << log;
  EXPECT_NE(result.output.find("status=2"), std::string::npos) << result.output << log;
  const auto seconds = std::stoi(result.output.substr(result.output.find("seconds=") + 8));
  EXPECT_LT(seconds, 60) << log;
  EXPECT_NE(log.find("rank " + std::to_string(killed)), std::string::npos) << log;
  EXPECT_NE(log.find("killed or crashed"), std::string::npos) << log;
  EXPECT_EQ(log.find("terminate called"), std::string::npos) << log;
}

TEST(Distributed, AKilledRankMakesTheOtherExitNamingIt) { expect_survivor_names(1, 0); }

TEST(Distributed, AKilledRankZeroMakesTheOtherExitNamingIt) { expect_survivor_names(0, 1); }

// NCCL does not notice a dead peer; the heartbeats do (trainer/dist/process_group.h).
TEST(Distributed, AKilledGpuRankMakesTheOtherExitNamingItWithinSeconds) {
  if (!has_two_gpus()) GTEST_SKIP() << "needs 2 CUDA GPUs";
  expect_survivor_names(1, 0, "cuda");
}

}  // namespace
}  // namespace qtrain
