#pragma once
// Copies between the host and a GPU that overlap the compute: each runs on a side stream of its
// device, after the work already queued on the current stream, and the current stream waits for
// it only where its result is used. Three lanes per device, so that what leaves the device
// (activation offloading, trainer/model/activation_offload.h), what comes to it ahead of use
// (a weight kept on the host, trainer/model/host_resident_weight.h) and the optimizer's state
// (trainer/optimizer_states_on_host.h: a decoder layer's share each way in the forward, up to
// gigabytes a step for a mixture of experts' adapters; in and out on lanes of their own, so
// both directions of the bus carry it at once) do not queue behind each other. Copies on one
// lane run in the order they were queued.
//
// On the CPU the same calls make plain copies, so the bookkeeping is tested there too.
#include <torch/torch.h>

#include <memory>
#include <string>

namespace qtrain::trainer {

enum class CopyLane { kOffload, kPrefetch, kOptimizerStateIn, kOptimizerStateOut };

// destination.copy_(source) on `lane`'s stream of `device`, once the work queued so far on the
// current stream is done (it produced `source`, or last used the memory `destination` now has);
// the device-side tensor is kept from reuse until the copy has run, whoever frees it first.
void copy_after_compute(const torch::Tensor& destination, const torch::Tensor& source, const torch::Device& device,
                        CopyLane lane);

// Blocks the host until every copy queued on `lane` of `device` has run (before a host buffer
// they read or write is freed). Nothing on the CPU.
void wait_for_copies(const torch::Device& device, CopyLane lane);

// Marks the point of a lane reached by the copies queued so far; wait() makes the device's
// current stream wait for them (not the host). On the CPU, copies are done when queued.
class CopyArrival {
 public:
  CopyArrival();
  ~CopyArrival();
  CopyArrival(CopyArrival&&) noexcept;
  CopyArrival& operator=(CopyArrival&&) noexcept;
  void record(const torch::Device& device, CopyLane lane);
  void wait(const torch::Device& device) const;

 private:
  struct Event;
  std::unique_ptr<Event> event_;
};

// `bytes` of page-locked host memory (uint8), as the driver pins them: cudaHostAlloc of exactly
// that size (PyTorch's pinned allocator rounds every block up to a power of two, which for a
// 1 GiB weight or long-context activations would pin up to twice the bytes). `for_what` names
// the recipe key in the out-of-memory Error. Plain host memory when `device` is the CPU.
torch::Tensor pinned_host_bytes(const torch::Device& device, int64_t bytes, const std::string& for_what);

// A tensor of `sizes` and `dtype` over `bytes` (a uint8 buffer, such as pinned_host_bytes gives)
// from byte `offset` on, a multiple of the dtype's size: how a buffer holds one or more tensors.
torch::Tensor typed_view(const torch::Tensor& bytes, int64_t offset, c10::IntArrayRef sizes, torch::ScalarType dtype);

}  // namespace qtrain::trainer
