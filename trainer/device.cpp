#include "trainer/device.h"

#include "kernels/error.h"

namespace qtrain::trainer {

torch::Device resolve_device(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (name == "cpu") return torch::kCPU;
  if (name.rfind("cuda", 0) == 0) {
    int64_t index = 0;
    if (name.size() > 4) {
      if (name[4] != ':' || name.size() == 5 || name.find_first_not_of("0123456789", 5) != std::string::npos) {
        throw Error("device '" + name + "': expected cpu, cuda, cuda:N or auto");
      }
      index = std::stoll(name.substr(5));
    }
    const auto count = static_cast<int64_t>(torch::cuda::device_count());
    if (count == 0) throw Error("device '" + name + "': no CUDA GPU is visible on this machine; use cpu");
    if (index >= count) {
      throw Error("device '" + name + "': only " + std::to_string(count) + " CUDA device(s) are visible");
    }
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw Error("device '" + name + "': expected cpu, cuda, cuda:N or auto");
}

}  // namespace qtrain::trainer
