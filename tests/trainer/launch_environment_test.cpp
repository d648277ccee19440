// Which rank a process is, read from torchrun's, Slurm's or Open MPI's variables.
#include <gtest/gtest.h>

#include <map>

#include "kernels/error.h"
#include "trainer/dist/launch_environment.h"

namespace qtrain::trainer {
namespace {

LaunchEnvironment read(const std::map<std::string, std::string>& variables) {
  return read_launch_environment([&](const char* name) -> const char* {
    const auto found = variables.find(name);
    return found == variables.end() ? nullptr : found->second.c_str();
  });
}

TEST(LaunchEnvironment, NoLauncherIsOneProcess) {
  const auto environment = read({});
  EXPECT_EQ(environment.world_size, 1);
  EXPECT_EQ(environment.rank, 0);
  EXPECT_FALSE(environment.distributed());
  EXPECT_EQ(environment.launcher, "none");
}

TEST(LaunchEnvironment, TorchrunVariables) {
  const auto environment = read({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                 {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29501"},
                                 {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(environment.launcher, "torchrun");
  EXPECT_EQ(environment.rank, 5);
  EXPECT_EQ(environment.world_size, 8);
  EXPECT_EQ(environment.local_rank, 1);
  EXPECT_EQ(environment.local_world_size, 4);
  EXPECT_EQ(environment.master_addr, "node0");
  EXPECT_EQ(environment.master_port, 29501);
  EXPECT_EQ(environment.restart_count, 2);
  EXPECT_TRUE(environment.agent_store);
  EXPECT_TRUE(environment.distributed());
}

TEST(LaunchEnvironment, SlurmStepVariables) {
  const auto environment = read({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                                 {"SLURM_NTASKS_PER_NODE", "2(x2)"}, {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "gpu-01"}});
  EXPECT_EQ(environment.launcher, "slurm");
  EXPECT_EQ(environment.rank, 3);
  EXPECT_EQ(environment.world_size, 4);
  EXPECT_EQ(environment.local_rank, 1);
  EXPECT_EQ(environment.local_world_size, 2);
  EXPECT_EQ(environment.master_addr, "gpu-01");
  EXPECT_EQ(environment.master_port, 29500);
}

TEST(LaunchEnvironment, ASlurmBatchScriptOutsideSrunIsOneProcess) {
  EXPECT_FALSE(read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}).distributed());
}

TEST(LaunchEnvironment, OpenMpiVariables) {
  const auto environment = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(environment.launcher, "openmpi");
  EXPECT_EQ(environment.rank, 1);
  EXPECT_EQ(environment.local_rank, 1);
  EXPECT_EQ(environment.master_addr, "127.0.0.1");  // one node: the loopback
}

TEST(LaunchEnvironment, TorchrunWinsOverAnEnclosingSrun) {
  const auto environment = read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"},
                                 {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "x"}});
  EXPECT_EQ(environment.launcher, "torchrun");
  EXPECT_EQ(environment.world_size, 2);
}

void expect_error(const std::map<std::string, std::string>& variables, const std::string& mentions) {
  try {
    read(variables);
    FAIL() << "expected an error mentioning " << mentions;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(mentions), std::string::npos) << error.what();
  }
}

TEST(LaunchEnvironment, BadValuesNameTheVariable) {
  expect_error({{"RANK", "one"}, {"WORLD_SIZE", "2"}}, "RANK='one'");
  expect_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "rank 2 is not below the world size 2");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT");
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_STEP_ID", "0"}},
               "MASTER_ADDR");
}

}  // namespace
}  // namespace qtrain::trainer
