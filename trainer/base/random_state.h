#pragma once
// The states of the default random generators a training step draws from (dropout): the
// CPU's and, on a GPU, that device's. Captured and restored by activation checkpointing (the
// recomputation must draw the same masks) and by training-state checkpoints.
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace qtrain::trainer {

struct RandomState {
  torch::Tensor cpu;     // uint8, the CPU generator's state
  torch::Tensor device;  // uint8, the GPU generator's state; undefined on a CPU
  torch::Device device_id = torch::kCPU;

  static RandomState capture(const torch::Device& device);
  void restore() const;

  // {"cpu", ...} and {"device", ...}, for a checkpoint file.
  std::vector<std::pair<std::string, torch::Tensor>> named() const;
  // From named(); entries the device does not have are ignored.
  static RandomState from_named(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                const torch::Device& device);
};

}  // namespace qtrain::trainer
