#include "trainer/model/activation_offload.h"

#include <chrono>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/error.h"
#include "trainer/base/memory_stats.h"
#include "trainer/model/device_copies.h"

namespace qtrain::trainer {

namespace {

// Host buffers (uint8) for one device's offloaded tensors, reused across steps. A request takes
// the smallest free buffer that fits; when none does, the free ones too small for it are released
// first, so sequences that grow over a run do not pile up pinned memory: the pool holds about
// one step's worth at the longest size seen.
class HostBufferPool {
 public:
  static HostBufferPool& instance() {
    static HostBufferPool pool;
    return pool;
  }

  torch::Tensor take(const torch::Device& device, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[device.is_cuda() ? device.index() : -1];
    const auto fits = free.lower_bound(bytes);
    if (fits != free.end()) {
      auto buffer = std::move(fits->second);
      free.erase(fits);
      return buffer;
    }
    // Copies queued from the buffers about to be released finish first.
    if (!free.empty()) wait_for_copies(device, CopyLane::kOffload);
    for (auto smaller = free.begin(); smaller != free.end();) {
      if (device.is_cuda()) pinned_bytes_ -= smaller->first;
      smaller = free.erase(smaller);
    }
    return allocate(device, bytes);
  }

  void give_back(const torch::Device& device, torch::Tensor buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[device.is_cuda() ? device.index() : -1].emplace(buffer.numel(), std::move(buffer));
  }

  int64_t pinned_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pinned_bytes_;
  }

  double pinning_seconds() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pinning_seconds_;
  }

  int64_t release_free() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t released = 0;
    for (auto& [device_index, free] : free_) {
      if (device_index >= 0 && !free.empty()) {
        wait_for_copies(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device_index)), CopyLane::kOffload);
      }
      for (const auto& [bytes, buffer] : free) {
        released += bytes;
        if (device_index >= 0) pinned_bytes_ -= bytes;
      }
      free.clear();
    }
    return released;
  }

 private:
  torch::Tensor allocate(const torch::Device& device, int64_t bytes) {
    const auto start = std::chrono::steady_clock::now();
    try {
      auto buffer = pinned_host_bytes(device, bytes, "train.offload_activations");
      if (device.is_cuda()) {  // on the CPU nothing is pinned
        pinning_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        pinned_bytes_ += bytes;
      }
      return buffer;
    } catch (const Error& error) {
      throw Error(ErrorCode::kOutOfMemory, std::string(error.what()) + " (" + format_bytes(pinned_bytes_) +
                                               " pinned for activations so far). Lower the tokens per micro-batch, turn "
                                               "train.offload_branch_outputs off (where on, each kept output pins as much as "
                                               "a layer input), or turn train.offload_activations off");
    }
  }

  std::mutex mutex_;
  std::map<int64_t, std::multimap<int64_t, torch::Tensor>> free_;  // device index (-1: CPU) -> bytes -> buffer
  int64_t pinned_bytes_ = 0;
  double pinning_seconds_ = 0;
};


}  // namespace

struct ActivationOffload::Stored {
  torch::Tensor host;  // uint8 buffer of the pool
  std::vector<int64_t> sizes;
  torch::ScalarType dtype = torch::kFloat32;
  torch::Tensor on_device;  // fetched and not yet taken
  bool fetched = false;
  bool taken = false;
  CopyArrival arrived;  // the copy back to the device is done

  torch::Tensor host_view() const {
    return typed_view(host, 0, sizes, dtype);
  }
};

ActivationOffload::ActivationOffload(const torch::Device& device) : device_(device) {}

ActivationOffload::~ActivationOffload() {
  // Tickets never taken (a forward without backward): their buffers go back for later steps.
  // Copies still queued into them run first, since every copy of the device shares one stream.
  for (auto& stored : stored_) {
    if (!stored->taken) HostBufferPool::instance().give_back(device_, std::move(stored->host));
  }
}

int64_t ActivationOffload::pinned_bytes() { return HostBufferPool::instance().pinned_bytes(); }
double ActivationOffload::pinning_seconds() { return HostBufferPool::instance().pinning_seconds(); }
int64_t ActivationOffload::release_unused_host_buffers() { return HostBufferPool::instance().release_free(); }

int64_t ActivationOffload::store(const torch::Tensor& tensor) {
  if (tensor.device() != device_) {
    throw Error(ErrorCode::kInternal, "an activation on " + tensor.device().str() + " was offloaded by the offload of " +
                                          device_.str());
  }
  const auto source = tensor.detach().contiguous();
  auto stored = std::make_unique<Stored>();
  stored->sizes = source.sizes().vec();
  stored->dtype = source.scalar_type();
  stored->host = HostBufferPool::instance().take(device_, std::max<int64_t>(source.numel() * source.element_size(), 1));
  copy_after_compute(stored->host_view(), source, device_, CopyLane::kOffload);
  stored_.push_back(std::move(stored));
  return static_cast<int64_t>(stored_.size()) - 1;
}

void ActivationOffload::fetch(int64_t ticket) {
  auto& stored = *stored_[ticket];
  stored.on_device = torch::empty(stored.sizes, torch::TensorOptions().dtype(stored.dtype).device(device_));
  // The new block may have been freed by compute work still queued: the copy waits for it.
  copy_after_compute(stored.on_device, stored.host_view(), device_, CopyLane::kOffload);
  stored.arrived.record(device_, CopyLane::kOffload);
  stored.fetched = true;
}

torch::Tensor ActivationOffload::take(int64_t ticket) {
  if (ticket < 0 || ticket >= static_cast<int64_t>(stored_.size()) || stored_[ticket]->taken) {
    throw Error(ErrorCode::kInternal, "offloaded activation " + std::to_string(ticket) + " of " +
                                          std::to_string(stored_.size()) + " was taken twice or never stored");
  }
  auto& stored = *stored_[ticket];
  if (!stored.fetched) fetch(ticket);
  if (ticket > 0 && !stored_[ticket - 1]->fetched && !stored_[ticket - 1]->taken) fetch(ticket - 1);
  stored.arrived.wait(device_);
  stored.taken = true;
  HostBufferPool::instance().give_back(device_, std::move(stored.host));
  return std::move(stored.on_device);
}

}  // namespace qtrain::trainer
