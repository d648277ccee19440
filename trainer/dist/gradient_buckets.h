#pragma once
// Data parallelism's gradient exchange, as DDP does it: the trainable parameters are grouped
// into buckets of about `bucket_bytes`, in the reverse of their registration order (the order
// backward produces their gradients), and each bucket's sum over the ranks starts as soon as
// its last gradient is accumulated, while backward goes on with the layers below. finish()
// waits for the buckets and writes the sums back into the .grad tensors.
//
// Only an armed backward communicates: the micro-batches of an accumulation window before its
// last one just accumulate locally. The sums are sums: the training step divides each rank's
// loss by the window's token count over all ranks, so summed gradients are the per-token mean
// of the global batch (DDP's average when every rank has as many tokens).
//
// Buckets are started in index order on every rank, whatever order their gradients complete
// in, because every rank must issue the same collectives in the same order.
//
// GradientReduction::kOrdered gathers every rank's bucket instead and adds them up in rank order,
// ((g0 + g1) + g2) + ...: the same bits on every machine and NCCL version, and the bits of one
// process accumulating one micro-batch of each rank in turn (an all-reduce adds in an order of
// its own choosing, which on more than two ranks moves the last bits). It moves world_size times
// the all-reduce's bytes into each rank: cheap for adapters, not for full-weight training.
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "trainer/dist/process_group.h"

namespace qtrain::trainer {

enum class GradientReduction { kAllReduce, kOrdered };

class GradientBuckets {
 public:
  GradientBuckets(std::vector<torch::Tensor> parameters, ProcessGroup& group, int64_t bucket_bytes,
                  GradientReduction reduction = GradientReduction::kAllReduce);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // The next backward's gradients are this step's last: reduce them as they become ready.
  void arm();
  // After that backward: reduces what is left (a parameter that got no gradient counts as
  // zero), waits for every bucket and writes the sums into the parameters' .grad.
  void finish();

  size_t bucket_count() const;

  struct State;  // shared with the autograd hooks, which may outlive this object

 private:
  std::shared_ptr<State> state_;
};

}  // namespace qtrain::trainer
