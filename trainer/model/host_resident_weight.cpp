#include "trainer/model/host_resident_weight.h"

#include "kernels/error.h"

namespace qtrain::trainer {

HostResidentWeight::HostResidentWeight(const torch::Tensor& weight, const torch::Device& device,
                                       const std::string& for_what) {
  const auto source = weight.detach().contiguous();
  const int64_t bytes = source.numel() * source.element_size();
  torch::Tensor buffer;
  try {
    buffer = pinned_host_bytes(device, std::max<int64_t>(bytes, 1), for_what);
  } catch (const Error& error) {
    throw Error(error.code(), std::string(error.what()) + ". Free host memory, or set " + for_what + ": false");
  }
  host_ = typed_view(buffer, 0, source.sizes(), source.scalar_type());
  host_.copy_(source);
}

void HostResidentWeight::prefetch(const torch::Device& device) {
  if (device.is_cpu()) {
    throw Error(ErrorCode::kInternal, "a host-resident weight was prefetched to the CPU, where it already is");
  }
  if (on_device_.defined() && on_device_.device() == device) return;
  // Allocated on the current stream, so that the block returns to its pool once the consumers,
  // which run there, let go of it; the copy waits for the work that last used that memory.
  on_device_ = torch::empty_like(host_, host_.options().device(device));
  copy_after_compute(on_device_, host_, device, CopyLane::kPrefetch);
  arrived_.record(device, CopyLane::kPrefetch);
}

torch::Tensor HostResidentWeight::take(const torch::Device& device) {
  prefetch(device);
  arrived_.wait(device);
  auto taken = std::move(on_device_);
  on_device_ = torch::Tensor();
  return taken;
}

}  // namespace qtrain::trainer
