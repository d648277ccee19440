#include "trainer/base/memory_stats.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#ifdef QTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

namespace qtrain::trainer {

namespace {

// VmRSS / VmHWM of /proc/self/status, in bytes (0 where the file is not there).
double proc_status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream fields(line.substr(key.size() + 1));
      double kibibytes = 0;
      fields >> kibibytes;
      return kibibytes * 1024.0;
    }
  }
  return 0;
}

}  // namespace

MemoryUsage memory_usage(const torch::Device& device) {
  MemoryUsage usage;
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    // Before its first allocation the caching allocator has no devices and holds nothing.
    if (!c10::cuda::CUDACachingAllocator::get()->initialized()) return usage;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto& allocated = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    usage.current_bytes = static_cast<double>(allocated.current);
    usage.peak_bytes = static_cast<double>(allocated.peak);
    const auto& reserved = stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    usage.reserved_bytes = static_cast<double>(reserved.current);
    return usage;
  }
#endif
  usage.current_bytes = proc_status_bytes("VmRSS");
  usage.peak_bytes = proc_status_bytes("VmHWM");
  return usage;
}

void reset_peak_memory(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda() && c10::cuda::CUDACachingAllocator::get()->initialized()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  }
#else
  (void)device;
#endif
}

double device_free_bytes(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device.index() < 0 ? 0 : device.index());
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      cudaGetLastError();  // no figure: the plan then fits nothing to it
      return 0;
    }
    return static_cast<double>(free);
  }
#endif
  (void)device;
  return 0;
}

void release_cached_memory(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#else
  (void)device;
#endif
}

void MemoryPhases::finish() {
  if (open_ < 0) return;
  auto& phase = phases_[static_cast<size_t>(open_)];
  phase.peak_bytes = std::max(phase.peak_bytes, memory_usage(device_).peak_bytes);
  open_ = -1;
}

void MemoryPhases::mark(const std::string& name) {
  finish();
  auto found = std::find_if(phases_.begin(), phases_.end(), [&](const Phase& phase) { return phase.name == name; });
  if (found == phases_.end()) found = phases_.insert(phases_.end(), Phase{name, 0, 0});
  reset_peak_memory(device_);
  found->at_start_bytes = std::max(found->at_start_bytes, memory_usage(device_).current_bytes);
  open_ = static_cast<int>(found - phases_.begin());
}

std::string format_bytes(double bytes) {
  char text[32];
  if (bytes >= 1024.0 * 1024.0 * 1024.0) {
    std::snprintf(text, sizeof text, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  } else {
    std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1024.0 * 1024.0));
  }
  return text;
}

}  // namespace qtrain::trainer
