#pragma once
// The ranks of a data-parallel run and the collectives between them, on LibTorch's c10d:
// a TCPStore for the rendezvous (served by rank 0, or by torchrun's agent), ProcessGroupNCCL
// for CUDA tensors and ProcessGroupGloo for CPU tensors.
//
// Failing fast: every collective has the recipe's timeout (dist.timeout_s). A rank that dies
// closes its connections, so the others fail at their next collective at once (Gloo), or
// within a few heartbeats (NCCL, whose waits watch the other ranks' heartbeats); a rank that
// hangs makes them fail at the timeout. Either way the error names the ranks that stopped: each
// rank bumps a heartbeat counter in the store every second, and the ranks whose counters no
// longer move (or rank 0, when its store is gone) are the ones reported.
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "trainer/dist/launch_environment.h"

namespace qtrain::trainer {

struct ProcessGroupOptions {
  std::string backend = "auto";  // auto (nccl for CUDA, gloo for CPU) | nccl | gloo
  std::chrono::seconds timeout{600};
};

class ProcessGroup {
 public:
  // Joins the run that `environment` describes; tensors live on `device` (this rank's GPU, or
  // the CPU). Error naming the address and what to check when the rendezvous times out.
  ProcessGroup(const LaunchEnvironment& environment, const torch::Device& device, const ProcessGroupOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const torch::Device& device() const { return device_; }
  const std::string& backend_name() const { return backend_name_; }

  // In-place sum over the ranks of a tensor on device(); returns at once, wait() completes it.
  c10::intrusive_ptr<c10d::Work> start_sum(torch::Tensor& tensor);
  // Every rank's `tensor` into row r of `gathered` ([world_size, numel], on device()); returns at
  // once, wait() completes it.
  c10::intrusive_ptr<c10d::Work> start_gather(torch::Tensor& tensor, torch::Tensor& gathered);
  // Blocks until `work` is done; on failure or timeout an Error naming `what` and the ranks
  // that stopped.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  // Elementwise sums of a few numbers (fp64), e.g. token counts and loss sums.
  std::vector<double> sum(const std::vector<double>& values, const std::string& what);
  // Every rank's `value`, in rank order, on every rank.
  std::vector<double> every_rank(double value, const std::string& what);
  // Rank `root`'s values of `tensors` (on device()) on every rank, in place.
  void broadcast(std::vector<torch::Tensor>& tensors, int64_t root, const std::string& what);
  // Returns once every rank has called it with the same `what`.
  void barrier(const std::string& what);

 private:
  [[noreturn]] void fail(const std::string& what, const std::string& cause);
  // Returns once `work` completed (successfully or not); Error when a peer fell silent or the
  // timeout passed.
  void watch_peers_until_done(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  void beat_heart();

  int64_t rank_;
  int64_t world_size_;
  torch::Device device_;
  std::string backend_name_;
  std::string address_;  // MASTER_ADDR:MASTER_PORT, for messages
  bool agent_store_;     // torchrun's agent serves the store, not rank 0
  std::chrono::seconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::atomic<bool> stopping_{false};
  std::thread heartbeat_;
};

}  // namespace qtrain::trainer
