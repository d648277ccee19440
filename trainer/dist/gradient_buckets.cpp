#include "trainer/dist/gradient_buckets.h"

#include <mutex>

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include "kernels/error.h"

namespace qtrain::trainer {

struct GradientBuckets::State {
  struct Bucket {
    std::vector<size_t> members;  // parameter indices
    torch::Tensor flat;           // the members' gradients end to end, [sum of numel]
    torch::Tensor gathered;       // kOrdered only: every rank's flat, [world_size, sum of numel]
    size_t ready = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };

  std::vector<torch::Tensor> parameters;
  // Held so that the accumulators, and the hooks on them, live as long as the buckets: a
  // tensor keeps its accumulator only weakly and would make a fresh one, hookless, per backward.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<size_t> bucket_of;  // parameter index -> bucket index
  std::vector<Bucket> buckets;
  ProcessGroup* group = nullptr;
  std::mutex mutex;  // hooks run on autograd's threads
  bool armed = false;
  std::vector<bool> parameter_ready;
  size_t next_to_start = 0;

  void copy_into_bucket(size_t index) {
    auto& bucket = buckets[bucket_of[index]];
    int64_t offset = 0;
    for (const size_t member : bucket.members) {
      if (member == index) break;
      offset += parameters[member].numel();
    }
    const auto& parameter = parameters[index];
    auto slice = bucket.flat.narrow(0, offset, parameter.numel());
    if (parameter.grad().defined()) {
      slice.copy_(parameter.grad().reshape({-1}));
    } else {
      slice.zero_();
    }
  }

  void mark_ready(size_t index) {
    if (parameter_ready[index]) return;
    parameter_ready[index] = true;
    copy_into_bucket(index);
    ++buckets[bucket_of[index]].ready;
    while (next_to_start < buckets.size() &&
           buckets[next_to_start].ready == buckets[next_to_start].members.size()) {
      auto& bucket = buckets[next_to_start];
      bucket.work = bucket.gathered.defined() ? group->start_gather(bucket.flat, bucket.gathered)
                                              : group->start_sum(bucket.flat);
      ++next_to_start;
    }
  }
};

GradientBuckets::GradientBuckets(std::vector<torch::Tensor> parameters, ProcessGroup& group, int64_t bucket_bytes,
                                 GradientReduction reduction)
    : state_(std::make_shared<State>()) {
  auto& state = *state_;
  state.parameters = std::move(parameters);
  state.group = &group;
  state.bucket_of.assign(state.parameters.size(), 0);
  state.parameter_ready.assign(state.parameters.size(), false);
  int64_t bytes = 0;
  for (size_t back = state.parameters.size(); back-- > 0;) {
    const auto& parameter = state.parameters[back];
    const int64_t size = parameter.numel() * static_cast<int64_t>(parameter.element_size());
    const bool same_kind = !state.buckets.empty() &&
                           state.parameters[state.buckets.back().members.front()].dtype() == parameter.dtype();
    if (state.buckets.empty() || !same_kind || bytes + size > bucket_bytes) {
      state.buckets.emplace_back();
      bytes = 0;
    }
    state.buckets.back().members.push_back(back);
    state.bucket_of[back] = state.buckets.size() - 1;
    bytes += size;
  }
  for (auto& bucket : state.buckets) {
    int64_t numel = 0;
    for (const size_t member : bucket.members) numel += state.parameters[member].numel();
    const auto& first = state.parameters[bucket.members.front()];
    bucket.flat = torch::zeros({numel}, first.options().requires_grad(false));
    if (reduction == GradientReduction::kOrdered) {
      bucket.gathered = torch::empty({group.world_size(), numel}, bucket.flat.options());
    }
  }
  // A post hook on each parameter's gradient accumulator fires once its .grad holds this
  // backward's contribution. The hooks stay with the parameters; they hold the state weakly.
  const std::weak_ptr<State> weak = state_;
  for (size_t index = 0; index < state.parameters.size(); ++index) {
    auto accumulator = torch::autograd::impl::grad_accumulator(state.parameters[index]);
    if (!accumulator) throw Error(ErrorCode::kInternal, "data parallelism: trainable parameter " + std::to_string(index) + " is not a leaf");
    state.accumulators.push_back(accumulator);
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto shared = weak.lock()) {
            std::lock_guard<std::mutex> lock(shared->mutex);
            if (shared->armed) shared->mark_ready(index);
          }
          return outputs;
        }));
  }
}

GradientBuckets::~GradientBuckets() = default;

size_t GradientBuckets::bucket_count() const { return state_->buckets.size(); }

void GradientBuckets::arm() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->armed = true;
  state_->next_to_start = 0;
  state_->parameter_ready.assign(state_->parameters.size(), false);
  for (auto& bucket : state_->buckets) {
    bucket.ready = 0;
    bucket.work.reset();
  }
}

void GradientBuckets::finish() {
  auto& state = *state_;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (!state.armed) throw Error(ErrorCode::kInternal, "GradientBuckets::finish() without arm(): the gradients were never reduced");
    for (size_t index = 0; index < state.parameters.size(); ++index) state.mark_ready(index);
    state.armed = false;
  }
  for (auto& bucket : state.buckets) {
    const bool ordered = bucket.gathered.defined();
    state.group->wait(bucket.work, ordered ? "the gradient all-gather" : "the gradient all-reduce");
    if (ordered) {
      bucket.flat.copy_(bucket.gathered[0]);
      for (int64_t rank = 1; rank < bucket.gathered.size(0); ++rank) bucket.flat.add_(bucket.gathered[rank]);
    }
    int64_t offset = 0;
    for (const size_t member : bucket.members) {
      auto& parameter = state.parameters[member];
      auto summed = bucket.flat.narrow(0, offset, parameter.numel()).view(parameter.sizes());
      if (parameter.grad().defined()) {
        parameter.mutable_grad().copy_(summed);
      } else {
        parameter.mutable_grad() = summed.clone();
      }
      offset += parameter.numel();
    }
  }
}

}  // namespace qtrain::trainer
