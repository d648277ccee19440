#pragma once
// Activation offloading (train.offload_activations): the inputs that gradient checkpointing keeps
// for each decoder layer (32 x tokens x hidden values for an 8B model) wait in pinned host memory
// between the forward and that layer's backward instead of on the GPU.
//
// Copies run on the device's offload lane (trainer/model/device_copies.h), so they overlap the
// compute: a layer's input leaves while the next layer runs forward; in backward, taking layer
// i's input starts bringing back layer i-1's, which arrives while layer i recomputes and
// differentiates. One layer's input is on the device ahead of its backward; the rest of them cost
// no device memory.
//
// The host buffers are pinned once and reused by later steps (a pool keyed by exact size:
// PyTorch's pinned allocator rounds every block up to a power of two, which at long context
// would ask the host for up to twice the bytes). On the CPU the same bookkeeping runs with
// plain copies, so the values a backward sees are the ones the forward stored, bit for bit.
#include <torch/torch.h>

#include <memory>
#include <vector>

namespace qtrain::trainer {

class ActivationOffload {
 public:
  explicit ActivationOffload(const torch::Device& device);
  ~ActivationOffload();
  ActivationOffload(const ActivationOffload&) = delete;
  ActivationOffload& operator=(const ActivationOffload&) = delete;

  // Starts copying `tensor` (on the offload's device) to the host, after the work queued so far
  // that produces it; the caller may drop its reference at once, and must not write to it (the copy
  // may still be reading it). Returns the ticket take() wants.
  int64_t store(const torch::Tensor& tensor);

  // The tensor stored under `ticket`, back on the device and ready for the current stream (a
  // fresh tensor without grad history). Also starts bringing back the one stored just before it,
  // as backward walks the layers down. Each ticket is taken once.
  torch::Tensor take(int64_t ticket);

  // Host bytes pinned by every offload of this process so far (kept for reuse by later steps),
  // and the seconds spent pinning them (the driver maps and locks every page: seconds for tens of
  // GiB, once per size a run reaches).
  static int64_t pinned_bytes();
  static double pinning_seconds();

  // Frees the host buffers no offload holds now (after training: evaluation and exports offload
  // nothing), once the copies queued on them are done. Returns the bytes freed, pinned or not.
  static int64_t release_unused_host_buffers();

 private:
  struct Stored;
  void fetch(int64_t ticket);

  torch::Device device_;
  std::vector<std::unique_ptr<Stored>> stored_;
};

}  // namespace qtrain::trainer
