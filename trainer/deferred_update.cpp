#include "trainer/deferred_update.h"

#include <unordered_map>

namespace qtrain::trainer {

DeferredUpdate::DeferredUpdate(LlamaForCausalLMImpl& model, optim::Optimizer& optimizer, const torch::Device& device)
    : model_(model), optimizer_(optimizer), gradients_(optimizer.parameters().size()) {
  const auto& parameters = optimizer_.parameters();
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  for (size_t index = 0; index < parameters.size(); ++index) index_of.emplace(parameters[index].unsafeGetTensorImpl(), index);
  const auto& layers = model_.model->layers;
  groups_.resize(1 + layers->size());
  std::vector<bool> in_layer(parameters.size(), false);
  for (size_t layer = 0; layer < layers->size(); ++layer) {
    for (const auto& parameter : layers->ptr(layer)->parameters()) {
      const auto found = index_of.find(parameter.unsafeGetTensorImpl());
      if (found == index_of.end() || in_layer[found->second]) continue;
      in_layer[found->second] = true;
      groups_[1 + layer].parameters.push_back(found->second);
    }
  }
  for (size_t index = 0; index < parameters.size(); ++index) {
    if (!in_layer[index]) groups_[0].parameters.push_back(index);
  }
  for (auto& group : groups_) {
    if (!group.parameters.empty()) group.state = std::make_unique<OptimizerStatesOnHost>(optimizer_, device, group.parameters);
  }
  model_.model->set_before_layer([this](size_t layer) { apply(1 + layer); });
}

DeferredUpdate::~DeferredUpdate() {
  model_.model->set_before_layer(nullptr);
  // Nothing may throw out of here.
  try {
    apply_all();
  } catch (...) {
  }
}

size_t DeferredUpdate::pending() const {
  size_t count = 0;
  for (const auto& group : groups_) count += group.pending ? 1 : 0;
  return count;
}

void DeferredUpdate::step(Group& group) {
  const auto& parameters = optimizer_.parameters();
  group.state->arrive();
  const double now = optimizer_.learning_rate();
  optimizer_.set_learning_rate(learning_rate_);
  optimizer_.step();  // only these parameters have a gradient
  optimizer_.set_learning_rate(now);
  group.state->depart();
  for (const size_t index : group.parameters) parameters[index].mutable_grad().reset();
}

void DeferredUpdate::defer() {
  apply_all();  // a forward applies them; a step without one between (a test, a tool) finds them here
  learning_rate_ = optimizer_.learning_rate();
  const auto& parameters = optimizer_.parameters();
  for (size_t group = 1; group < groups_.size(); ++group) {
    for (const size_t index : groups_[group].parameters) {
      gradients_[index] = parameters[index].grad();
      parameters[index].mutable_grad().reset();
    }
    groups_[group].pending = groups_[group].state != nullptr;
  }
  if (groups_[0].state) step(groups_[0]);
  // The first layer's share travels before the next forward reaches it.
  for (size_t group = 1; group < groups_.size(); ++group) {
    if (groups_[group].pending) {
      groups_[group].state->prefetch();
      break;
    }
  }
}

void DeferredUpdate::apply(size_t group_index) {
  if (group_index >= groups_.size() || !groups_[group_index].pending) return;
  auto& group = groups_[group_index];
  group.pending = false;
  for (size_t next = group_index + 1; next < groups_.size(); ++next) {
    if (groups_[next].pending) {
      groups_[next].state->prefetch();  // while this layer runs
      break;
    }
  }
  const auto& parameters = optimizer_.parameters();
  for (const size_t index : group.parameters) parameters[index].mutable_grad() = std::move(gradients_[index]);
  step(group);
}

void DeferredUpdate::apply_all() {
  for (size_t group = 1; group < groups_.size(); ++group) apply(group);
}

void DeferredUpdate::settle() const {
  for (const auto& group : groups_) {
    if (group.state) group.state->settle();
  }
}

}  // namespace qtrain::trainer
