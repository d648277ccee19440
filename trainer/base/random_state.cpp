#include "trainer/base/random_state.h"

#include <ATen/Context.h>

#include <mutex>

namespace qtrain::trainer {

namespace {

torch::Tensor generator_state(const torch::Device& device) {
  auto generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(const torch::Device& device, const torch::Tensor& state) {
  auto generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace

RandomState RandomState::capture(const torch::Device& device) {
  RandomState state;
  state.device_id = device;
  state.cpu = generator_state(torch::kCPU);
  if (!device.is_cpu()) state.device = generator_state(device);
  return state;
}

void RandomState::restore() const {
  if (cpu.defined()) set_generator_state(torch::kCPU, cpu);
  if (device.defined()) set_generator_state(device_id, device);
}

std::vector<std::pair<std::string, torch::Tensor>> RandomState::named() const {
  std::vector<std::pair<std::string, torch::Tensor>> tensors = {{"cpu", cpu}};
  if (device.defined()) tensors.emplace_back("device", device);
  return tensors;
}

RandomState RandomState::from_named(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                    const torch::Device& device) {
  RandomState state;
  state.device_id = device;
  for (const auto& [name, tensor] : tensors) {
    if (name == "cpu") state.cpu = tensor;
    if (name == "device" && !device.is_cpu()) state.device = tensor;
  }
  return state;
}

}  // namespace qtrain::trainer
