#include "trainer/dist/launch_environment.h"

#include <cstdlib>
#include <optional>

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

class Variables {
 public:
  explicit Variables(const std::function<const char*(const char*)>& lookup) : lookup_(lookup) {}

  std::optional<std::string> text(const char* name) const {
    const char* value = lookup_(name);
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  }

  // The integer in `name`, or `fallback` when it is not set.
  int64_t integer(const char* name, int64_t fallback, int64_t minimum = 0) const {
    const auto value = text(name);
    if (!value) return fallback;
    size_t used = 0;
    int64_t number = 0;
    try {
      number = std::stoll(*value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != value->size() || number < minimum) {
      throw Error(ErrorCode::kDistributed, "environment variable " + std::string(name) + "='" + *value + "': expected an integer >= " +
                  std::to_string(minimum) + " (set by the launcher: torchrun, srun or mpirun)");
    }
    return number;
  }

 private:
  const std::function<const char*(const char*)>& lookup_;
};

// Slurm writes tasks per node as "4" or, for uneven layouts, "4(x2),3"; the first count is this
// layout's local world size on the first nodes.
int64_t slurm_tasks_per_node(const Variables& variables, int64_t world_size) {
  const auto value = variables.text("SLURM_NTASKS_PER_NODE");
  if (!value) return world_size;
  return std::max<int64_t>(1, std::atoll(value->c_str()));
}

}  // namespace

LaunchEnvironment read_launch_environment(const std::function<const char*(const char*)>& lookup) {
  const Variables variables(lookup);
  LaunchEnvironment environment;
  if (variables.text("RANK") && variables.text("WORLD_SIZE")) {
    environment.launcher = "torchrun";
    environment.rank = variables.integer("RANK", 0);
    environment.world_size = variables.integer("WORLD_SIZE", 1, 1);
    environment.local_rank = variables.integer("LOCAL_RANK", environment.rank);
    environment.local_world_size = variables.integer("LOCAL_WORLD_SIZE", environment.world_size, 1);
    environment.restart_count = variables.integer("TORCHELASTIC_RESTART_COUNT", 0);
    environment.agent_store = variables.text("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  } else if (variables.text("SLURM_PROCID") && variables.text("SLURM_NTASKS") &&
             (variables.text("SLURM_STEP_ID") || variables.text("SLURM_STEPID"))) {
    environment.launcher = "slurm";
    environment.rank = variables.integer("SLURM_PROCID", 0);
    environment.world_size = variables.integer("SLURM_NTASKS", 1, 1);
    environment.local_rank = variables.integer("SLURM_LOCALID", 0);
    environment.local_world_size = slurm_tasks_per_node(variables, environment.world_size);
  } else if (variables.text("OMPI_COMM_WORLD_RANK") && variables.text("OMPI_COMM_WORLD_SIZE")) {
    environment.launcher = "openmpi";
    environment.rank = variables.integer("OMPI_COMM_WORLD_RANK", 0);
    environment.world_size = variables.integer("OMPI_COMM_WORLD_SIZE", 1, 1);
    environment.local_rank = variables.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    environment.local_world_size = variables.integer("OMPI_COMM_WORLD_LOCAL_SIZE", environment.world_size, 1);
  } else {
    return environment;
  }
  if (environment.rank >= environment.world_size) {
    throw Error(ErrorCode::kDistributed, "launcher (" + environment.launcher + "): rank " + std::to_string(environment.rank) +
                " is not below the world size " + std::to_string(environment.world_size));
  }
  if (environment.local_rank >= environment.local_world_size) {
    throw Error(ErrorCode::kDistributed, "launcher (" + environment.launcher + "): local rank " + std::to_string(environment.local_rank) +
                " is not below the local world size " + std::to_string(environment.local_world_size));
  }
  environment.master_port = variables.integer("MASTER_PORT", 29500, 1);
  if (environment.master_port > 65535) throw Error(ErrorCode::kDistributed, "MASTER_PORT must be a TCP port (1..65535)");
  if (const auto address = variables.text("MASTER_ADDR")) {
    environment.master_addr = *address;
  } else if (environment.local_world_size < environment.world_size) {
    throw Error(ErrorCode::kDistributed, "launcher (" + environment.launcher + "): a run over several nodes needs MASTER_ADDR, the host of "
                "rank 0; under Slurm: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)");
  }
  return environment;
}

}  // namespace qtrain::trainer
