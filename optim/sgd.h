#pragma once
// Stochastic gradient descent with optional heavy-ball or Nesterov momentum and L2 weight decay,
// the update of torch.optim.SGD with dampening 0:
//   d   <- g + weight_decay * p
//   buf <- d on the first step, then momentum * buf + d          (when momentum > 0)
//   d   <- d + momentum * buf (nesterov) or buf                   (when momentum > 0)
//   p   <- p - lr * d
// State per parameter once it stepped with momentum > 0: "momentum_buffer"; bf16/fp16
// parameters also keep an fp32 "master" copy (see optimizer.h). On CPU it is
// torch::optim::SGD's op for op (bitwise equal).
#include "optim/optimizer.h"

namespace qtrain::optim {

struct SgdOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class Sgd : public Optimizer {
 public:
  Sgd(std::vector<torch::Tensor> parameters, const SgdOptions& options);
  void step() override;
  const SgdOptions& options() const { return options_; }

 protected:
  std::vector<std::string> state_fields(size_t index) const override;

 private:
  SgdOptions options_;
};

}  // namespace qtrain::optim
