// Which rank a process is, read from torchrun's, Slurm's or Open MPI's variables.
#include <gtest/gtest.h>

#include <map>
#include <string>

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

// Where `environment` places its process, as "LAUNCHER rank R/WORLD local L/LOCAL_WORLD ADDR:PORT".
std::string placement(const LaunchEnvironment& environment) {
  return environment.launcher + " rank " + std::to_string(environment.rank) + "/" + std::to_string(environment.world_size) +
         " local " + std::to_string(environment.local_rank) + "/" + std::to_string(environment.local_world_size) + " " +
         environment.master_addr + ":" + std::to_string(environment.master_port);
}

TEST(LaunchEnvironment, NoLauncherIsOneProcess) {
  const auto environment = read({});
  EXPECT_EQ(placement(environment), "none rank 0/1 local 0/1 127.0.0.1:29500");
  EXPECT_FALSE(environment.distributed());
}

TEST(LaunchEnvironment, TorchrunVariables) {
  const auto environment = read({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                 {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29501"},
                                 {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(placement(environment), "torchrun rank 5/8 local 1/4 node0:29501");
  EXPECT_EQ(environment.restart_count, 2);
  EXPECT_TRUE(environment.agent_store);
  EXPECT_TRUE(environment.distributed());
}

TEST(LaunchEnvironment, SlurmStepVariables) {
  const auto environment = read({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                                 {"SLURM_NTASKS_PER_NODE", "2(x2)"}, {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "gpu-01"}});
  EXPECT_EQ(placement(environment), "slurm rank 3/4 local 1/2 gpu-01:29500");
}

TEST(LaunchEnvironment, ASlurmBatchScriptOutsideSrunIsOneProcess) {
  EXPECT_FALSE(read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}).distributed());
}

TEST(LaunchEnvironment, OpenMpiVariables) {
  const auto environment = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(placement(environment), "openmpi rank 1/2 local 1/2 127.0.0.1:29500");  // one node: the loopback
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
