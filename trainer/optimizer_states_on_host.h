#pragma once
// train.optimizer_states_on_host: the optimizer's state (AdamW's two fp32 moments, a master copy,
// the step counters: 8-12 bytes a trained fp32 value) waits in pinned host memory between steps.
// A keeper holds the state of some of the optimizer's parameters (all, or one decoder layer's:
// trainer/deferred_update.h applies each layer's update in the next forward, just before the
// layer runs, so the device holds a layer's share or two at a time, never the whole).
//
// A keeper's state travels as one buffer: every state tensor is a view of one pinned host block
// and, on the device, of one device block of the same layout, so each way is one copy, on a copy
// lane of its own for each direction (trainer/model/device_copies.h), overlapped with compute.
// The update sees the same values: steps are equal bit for bit with the state kept on the device.
// On the CPU the same bookkeeping runs with plain copies.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "trainer/model/device_copies.h"

namespace qtrain::trainer {

class OptimizerStatesOnHost {
 public:
  // Holds a reference: the optimizer outlives this. `device`: the trained parameters'.
  // `parameters`: indices into optimizer.parameters() whose state this keeps; empty: every one.
  OptimizerStatesOnHost(optim::Optimizer& optimizer, const torch::Device& device, std::vector<size_t> parameters = {});
  ~OptimizerStatesOnHost();
  OptimizerStatesOnHost(const OptimizerStatesOnHost&) = delete;
  OptimizerStatesOnHost& operator=(const OptimizerStatesOnHost&) = delete;

  // Starts bringing the state to the device, after the work queued so far; nothing when it is
  // there already (before the first step, or fetched this step).
  void prefetch();
  // Before optimizer.step(): the state is on the device (fetched now if prefetch() was not called)
  // and the current stream waits for its copy.
  void arrive();
  // After optimizer.step(): the state starts back to the host and the optimizer holds the host
  // copy from now on; the device block goes back to the allocator once the copy has read it.
  void depart();
  // Before the host reads the state (a checkpoint): the copies to the host are done.
  void settle() const;
  // The state's slots in the optimizer, this keeper's parameters'.
  std::vector<std::pair<std::string, torch::Tensor*>> slots();

  bool on_host() const { return on_host_; }
  int64_t host_bytes() const { return host_block_.defined() ? host_block_.numel() : 0; }

 private:
  struct Entry {
    std::string name;
    int64_t offset;
    std::vector<int64_t> sizes;
    torch::ScalarType dtype;
  };
  // The layout for the optimizer's slots now, with a fresh host block, unless it has it already
  // (false).
  bool lay_out(const std::vector<std::pair<std::string, torch::Tensor*>>& slots);

  optim::Optimizer& optimizer_;
  torch::Device device_;
  std::vector<size_t> parameters_;
  std::vector<Entry> layout_;
  torch::Tensor host_block_;    // pinned uint8, the state between steps
  torch::Tensor device_block_;  // uint8, the state from prefetch() to depart()
  CopyArrival fetched_;         // the copy of the host block to the device
  CopyArrival returned_;        // the copy back to the host block (on the other lane)
  bool on_host_ = false;
  bool fetch_pending_ = false;
};

}  // namespace qtrain::trainer
