#pragma once
// Where this process stands in a multi-process run, read from what its launcher set:
//   torchrun:  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
//              TORCHELASTIC_RESTART_COUNT
//   Slurm:     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (inside an
//              `srun` step only: a batch script alone also sees SLURM_NTASKS but is one process)
//   Open MPI:  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
// torchrun's variables win when several launchers are nested (torchrun inside an srun step).
// Slurm and Open MPI do not choose a rendezvous address: MASTER_ADDR names the host of rank 0
// (MASTER_PORT defaults to 29500); on a single node 127.0.0.1 is assumed.
// Without a launcher: rank 0 of 1, no process group.
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>

namespace qtrain::trainer {

struct LaunchEnvironment {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;  // the GPU this process uses
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  int64_t restart_count = 0;  // torchrun's restarts of a failed run so far
  // torchrun's agent already serves the rendezvous store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects as a client.
  bool agent_store = false;
  std::string launcher = "none";  // none | torchrun | slurm | openmpi

  bool distributed() const { return world_size > 1; }
};

// `lookup` returns a variable's value or nullptr (std::getenv by default). Error naming the
// variable when a value is not an integer or out of range, or when a multi-node run lacks
// MASTER_ADDR.
LaunchEnvironment read_launch_environment(
    const std::function<const char*(const char*)>& lookup = [](const char* name) { return std::getenv(name); });

}  // namespace qtrain::trainer
