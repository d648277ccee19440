#pragma once
// AdamW with decoupled weight decay (Loshchilov & Hutter), the update of torch.optim.AdamW:
//   p   <- p - lr * weight_decay * p
//   m   <- beta1 * m + (1 - beta1) * g
//   v   <- beta2 * v + (1 - beta2) * g^2
//   p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State per parameter: "step" (fp32 scalar), "exp_avg" (m), "exp_avg_sq" (v), and for bf16/fp16
// parameters an fp32 "master" copy (see optimizer.h); m and v are fp32 for those parameters.
//
// On CPU the update is torch::optim::AdamW's op for op (bitwise equal). On CUDA all parameters
// of one device are updated by one fused kernel (at::_fused_adamw_, PyTorch's fused=True path),
// which agrees with the CPU path to fp32 rounding.
#include "optim/optimizer.h"

namespace qtrain::optim {

struct AdamWOptions {
  double lr = 2e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// betas in [0, 1), eps and weight_decay >= 0; an Error naming the optim key otherwise.
void check_adamw_options(const AdamWOptions& options);

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<torch::Tensor> parameters, const AdamWOptions& options);
  void step() override;
  const AdamWOptions& options() const { return options_; }

 protected:
  std::vector<std::string> state_fields(size_t index) const override;

 private:
  // Creates the zero state of parameter `index` on its first step.
  void initialise_state(size_t index);
  // The reference update of one parameter (CPU, or tensors the fused kernel cannot take).
  void step_reference(size_t index);
  // One fused update of parameters `indices`, all on the same CUDA device.
  void step_fused(const std::vector<size_t>& indices);

  AdamWOptions options_;
};

}  // namespace qtrain::optim
