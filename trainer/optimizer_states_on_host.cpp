#include "trainer/optimizer_states_on_host.h"

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

// Every state tensor starts at a multiple of this in the blocks: the fused update's vector loads
// find their data aligned as in tensors of their own.
constexpr int64_t kAlignment = 256;

}  // namespace

OptimizerStatesOnHost::OptimizerStatesOnHost(optim::Optimizer& optimizer, const torch::Device& device,
                                             std::vector<size_t> parameters)
    : optimizer_(optimizer), device_(device), parameters_(std::move(parameters)) {
  if (parameters_.empty()) {
    parameters_.resize(optimizer_.parameters().size());
    for (size_t index = 0; index < parameters_.size(); ++index) parameters_[index] = index;
  }
}

std::vector<std::pair<std::string, torch::Tensor*>> OptimizerStatesOnHost::slots() {
  return optimizer_.state_slots(parameters_);
}

OptimizerStatesOnHost::~OptimizerStatesOnHost() {
  // The optimizer is left as it was found, its state on the device (a later step, an export or a
  // test reads it there); nothing may throw out of here.
  try {
    arrive();
    settle();
  } catch (...) {
  }
}

bool OptimizerStatesOnHost::lay_out(const std::vector<std::pair<std::string, torch::Tensor*>>& slots) {
  bool same = slots.size() == layout_.size();
  for (size_t index = 0; same && index < slots.size(); ++index) {
    const auto& tensor = *slots[index].second;
    same = slots[index].first == layout_[index].name && tensor.sizes().equals(layout_[index].sizes) &&
           tensor.scalar_type() == layout_[index].dtype;
  }
  if (same && host_block_.defined()) return false;
  if (host_block_.defined()) {
    // The old block goes: nothing may still copy to or from it.
    settle();
  }
  layout_.clear();
  int64_t bytes = 0;
  for (const auto& [name, slot] : slots) {
    layout_.push_back({name, bytes, slot->sizes().vec(), slot->scalar_type()});
    bytes += (slot->numel() * static_cast<int64_t>(slot->element_size()) + kAlignment - 1) / kAlignment * kAlignment;
  }
  try {
    host_block_ = pinned_host_bytes(device_, std::max<int64_t>(bytes, 1), "train.optimizer_states_on_host");
  } catch (const Error& error) {
    throw Error(error.code(), std::string(error.what()) + ". Free host memory, or set train.optimizer_states_on_host: false");
  }
  return true;
}

void OptimizerStatesOnHost::prefetch() {
  if (!on_host_) return;
  const auto slots = this->slots();
  const auto base = static_cast<const uint8_t*>(host_block_.data_ptr());
  for (size_t index = 0; index < slots.size(); ++index) {
    if (index >= layout_.size() || slots[index].second->data_ptr() != base + layout_[index].offset) {
      on_host_ = false;  // the optimizer was given other state (a checkpoint loaded): it is where that is
      return;
    }
  }
  // After the last step's copy back into the host block (on the other lane; long done, as a rule).
  returned_.wait(device_);
  device_block_ = torch::empty({host_block_.numel()}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
  copy_after_compute(device_block_, host_block_, device_, CopyLane::kOptimizerStateIn);
  fetched_.record(device_, CopyLane::kOptimizerStateIn);
  for (size_t index = 0; index < slots.size(); ++index) {
    const auto& entry = layout_[index];
    *slots[index].second = typed_view(device_block_, entry.offset, entry.sizes, entry.dtype);
  }
  on_host_ = false;
  fetch_pending_ = true;
}

void OptimizerStatesOnHost::arrive() {
  prefetch();
  if (fetch_pending_) fetched_.wait(device_);
  fetch_pending_ = false;
}

void OptimizerStatesOnHost::depart() {
  if (on_host_) return;
  // A skipped step departs without arriving: its copy back must not read the device block before
  // the prefetch lane has filled it.
  arrive();
  const auto slots = this->slots();
  if (slots.empty()) return;  // no step taken yet
  // The state is the device block's views (fetched this step) or tensors of its own (the first
  // step's, a loaded checkpoint's): one copy of the block, or one per tensor.
  const bool relaid = lay_out(slots);
  const auto* block = device_block_.defined() ? static_cast<const uint8_t*>(device_block_.data_ptr()) : nullptr;
  bool in_block = !relaid && block != nullptr;
  for (size_t index = 0; in_block && index < slots.size(); ++index) {
    in_block = slots[index].second->data_ptr() == block + layout_[index].offset;
  }
  if (in_block) {
    copy_after_compute(host_block_, device_block_, device_, CopyLane::kOptimizerStateOut);
  } else {
    for (size_t index = 0; index < slots.size(); ++index) {
      const auto& entry = layout_[index];
      copy_after_compute(typed_view(host_block_, entry.offset, entry.sizes, entry.dtype), *slots[index].second, device_,
                         CopyLane::kOptimizerStateOut);
    }
  }
  returned_.record(device_, CopyLane::kOptimizerStateOut);
  for (size_t index = 0; index < slots.size(); ++index) {
    const auto& entry = layout_[index];
    *slots[index].second = typed_view(host_block_, entry.offset, entry.sizes, entry.dtype);
  }
  device_block_ = torch::Tensor();
  on_host_ = true;
  fetch_pending_ = false;
}

// Waiting for both lanes waits for every copy of the block (and of other keepers' blocks).
void OptimizerStatesOnHost::settle() const {
  wait_for_copies(device_, CopyLane::kOptimizerStateIn);
  wait_for_copies(device_, CopyLane::kOptimizerStateOut);
}

}  // namespace qtrain::trainer
