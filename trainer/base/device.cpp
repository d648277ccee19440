#include "trainer/base/device.h"

#ifdef QTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "kernels/error.h"

namespace qtrain::trainer {

torch::Device resolve_device(const std::string& name, int64_t local_rank) {
  if (name == "cpu" || (name == "auto" && !torch::cuda::is_available())) return torch::kCPU;
  if (name == "auto" || name.rfind("cuda", 0) == 0) {
    int64_t index = local_rank;
    if (name.size() > 4) {
      if (name[4] != ':' || name.size() == 5 || name.find_first_not_of("0123456789", 5) != std::string::npos) {
        throw Error(ErrorCode::kUsage, "device '" + name + "': expected cpu, cuda, cuda:N or auto");
      }
      index = std::stoll(name.substr(5));
    }
    const auto count = static_cast<int64_t>(torch::cuda::device_count());
    if (count == 0) throw Error(ErrorCode::kUsage, "device '" + name + "': no CUDA GPU is visible on this machine; use cpu");
    if (index >= count) {
      throw Error(ErrorCode::kUsage, "device '" + name + "' (GPU " + std::to_string(index) + "): only " + std::to_string(count) +
                  " CUDA device(s) are visible; start at most that many processes per node");
    }
#ifdef QTRAIN_WITH_CUDA
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#endif
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw Error(ErrorCode::kUsage, "device '" + name + "': expected cpu, cuda, cuda:N or auto");
}

}  // namespace qtrain::trainer
