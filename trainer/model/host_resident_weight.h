#pragma once
// A frozen weight that lives in pinned host memory and visits the device for one use at a time
// (train.lm_head_on_host: Llama-3-8B's lm_head is 1 GiB of bf16 that only the loss reads).
//
// prefetch() queues its copy to the device on the prefetch lane (trainer/model/device_copies.h),
// so that it travels while the decoder layers run forward; take() hands the copy over, ready for
// the current stream. The caller's references are the only ones: the device memory goes back to
// the caching allocator as soon as the last user (the loss's backward) lets go of it, before the
// layers' backward, where a checkpointed run peaks.
#include <torch/torch.h>

#include "trainer/model/device_copies.h"

namespace qtrain::trainer {

class HostResidentWeight {
 public:
  // Copies `weight` (any device) into host memory, pinned when `device`, where it will be used, is
  // a GPU; `for_what` names the recipe key in errors.
  HostResidentWeight(const torch::Tensor& weight, const torch::Device& device, const std::string& for_what);

  // The host tensor (pinned where CUDA is): what the module's parameter is set to.
  const torch::Tensor& host() const { return host_; }

  // Starts the copy to `device` after the work queued so far; a copy already on its way stays.
  void prefetch(const torch::Device& device);

  // The weight on `device`, ready for the current stream: the prefetched copy, or one made now.
  torch::Tensor take(const torch::Device& device);

 private:
  torch::Tensor host_;
  torch::Tensor on_device_;  // prefetched, not yet taken
  CopyArrival arrived_;
};

}  // namespace qtrain::trainer
