#include "trainer/model/device_copies.h"

#include <map>
#include <mutex>

#ifdef QTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "kernels/error.h"
#include "trainer/base/memory_stats.h"

namespace qtrain::trainer {

namespace {

#ifdef QTRAIN_WITH_CUDA
// One stream per device and lane for every copy of the process, created on first use.
c10::cuda::CUDAStream lane_stream(c10::DeviceIndex device, CopyLane lane) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, CopyLane>, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, lane);
  const auto found = streams.find(key);
  if (found != streams.end()) return found->second;
  return streams.emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)).first->second;
}
#endif

}  // namespace

void copy_after_compute(const torch::Tensor& destination, const torch::Tensor& source, const torch::Device& device,
                        CopyLane lane) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const auto copies = lane_stream(device.index(), lane);
    at::cuda::CUDAEvent queued;
    queued.record(c10::cuda::getCurrentCUDAStream(device.index()));
    queued.block(copies);
    {
      const c10::cuda::CUDAStreamGuard on_copies(copies);
      destination.copy_(source, /*non_blocking=*/true);
    }
    (destination.is_cuda() ? destination : source).record_stream(copies);
    return;
  }
#endif
  (void)lane;
  (void)device;
  destination.copy_(source);
}

void wait_for_copies(const torch::Device& device, CopyLane lane) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) lane_stream(device.index(), lane).synchronize();
#endif
  (void)device;
  (void)lane;
}

struct CopyArrival::Event {
#ifdef QTRAIN_WITH_CUDA
  at::cuda::CUDAEvent event;
#endif
  bool recorded = false;
};

CopyArrival::CopyArrival() : event_(std::make_unique<Event>()) {}
CopyArrival::~CopyArrival() = default;
CopyArrival::CopyArrival(CopyArrival&&) noexcept = default;
CopyArrival& CopyArrival::operator=(CopyArrival&&) noexcept = default;

void CopyArrival::record(const torch::Device& device, CopyLane lane) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) event_->event.record(lane_stream(device.index(), lane));
#endif
  (void)lane;
  event_->recorded = device.is_cuda();
}

void CopyArrival::wait(const torch::Device& device) const {
#ifdef QTRAIN_WITH_CUDA
  if (event_->recorded && device.is_cuda()) event_->event.block(c10::cuda::getCurrentCUDAStream(device.index()));
#endif
  (void)device;
}

torch::Tensor pinned_host_bytes(const torch::Device& device, int64_t bytes, const std::string& for_what) {
  const auto options = torch::TensorOptions().dtype(torch::kUInt8);
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    void* pointer = nullptr;
    const auto status = cudaHostAlloc(&pointer, static_cast<size_t>(bytes), cudaHostAllocDefault);
    if (status != cudaSuccess) {
      const std::string reason = cudaGetErrorString(cudaGetLastError());
      throw Error(ErrorCode::kOutOfMemory, for_what + " could not pin " + format_bytes(static_cast<double>(bytes)) +
                                               " of host memory: " + reason);
    }
    return torch::from_blob(pointer, {bytes}, [](void* block) { cudaFreeHost(block); }, options);
  }
#endif
  (void)for_what;
  (void)device;
  return torch::empty({bytes}, options);
}

torch::Tensor typed_view(const torch::Tensor& bytes, int64_t offset, c10::IntArrayRef sizes, torch::ScalarType dtype) {
  const auto element = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t length = c10::multiply_integers(sizes) * element;
  if (bytes.scalar_type() != torch::kUInt8 || bytes.dim() != 1 || !bytes.is_contiguous() || offset < 0 ||
      offset % element != 0 || (bytes.storage_offset() + offset) % element != 0 || offset + length > bytes.numel()) {
    throw Error(ErrorCode::kInternal, "a typed view of " + std::to_string(length) + " bytes at " + std::to_string(offset) +
                                          " does not fit a buffer of " + std::to_string(bytes.numel()) + " bytes");
  }
  // Made as the view operators make theirs, without their dispatch: the optimizer's state is
  // hundreds of these each way a step, on the backward's thread.
  auto view = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(bytes.storage()), bytes.key_set(),
                                                       c10::scalarTypeToTypeMeta(dtype));
  view.unsafeGetTensorImpl()->set_storage_offset((bytes.storage_offset() + offset) / element);
  view.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return view;
}

}  // namespace qtrain::trainer
