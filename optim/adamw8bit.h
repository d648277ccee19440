#pragma once
// 8-bit AdamW: bitsandbytes' AdamW8bit (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
// Quantization"). The two moments live as 8-bit codes of a dynamic map in blocks of 256 values,
// each block with an fp32 absmax (kernels/blockwise_8bit.h): the signed map for the first moment m,
// the unsigned map for the second moment v. That is 2 bytes per parameter plus 8 bytes per 256,
// against AdamW's 8: a quarter of the optimizer state (the fp32 master of a bf16/fp16 parameter,
// optimizer.h, is extra in both).
//
// One step, in fp32, in the order of bnb's kernel (kOptimizerStatic8bit2StateBlockwise):
//   c1 = 1 - beta1^t,  c2 = sqrt(1 - beta2^t),  step_size = -lr * c2 / c1
//   m  = map1[state1] * absmax1,  v = map2[state2] * absmax2        (dequantize)
//   v  = v * beta2 + ((1 - beta2) * g) * g,  m = m * beta1 + (1 - beta1) * g
//        (both 0 where g is NaN or inf, and the parameter is left as it was there)
//   p  = p + step_size * m / (sqrt(v) + c2 * eps),  then  p = p * (1 - lr * weight_decay)
//   state1, absmax1 = quantize_blockwise(m, map1, 256); state2, absmax2 = ... (v, map2)
//   where the code of m has the other sign than m (possible near zero), it moves one code
//   towards m's sign, so that a moment never flips sign by quantization.
// Weight decay is applied after the Adam step (bnb's order; torch's AdamW decays first).
// bnb's search (quantize_2D) starts its bracket at [-1, 1] for the signed map and [0, 1] for the
// unsigned one: the maps' own end values, so kernels::dynamic_map_code picks the same codes.
//
// Parameters with fewer than min_8bit_size (4096) elements keep fp32 moments, updated as bnb's
// 32-bit kernel (kOptimizer32bit2State) does: the same formulas without the NaN guard.
//
// State per parameter, as stored in checkpoints (the 8-bit codes as they are):
//   8-bit: "step" (fp32 scalar), "state1", "state2" (uint8, the parameter's shape), "absmax1",
//          "absmax2" (fp32 [ceil(n / 256)]);
//   32-bit: "step", "exp_avg", "exp_avg_sq" (fp32, the parameter's shape);
//   both: "master" for bf16/fp16 parameters.
//
// Agreement with bitsandbytes (fixture bnb-8bit-reference.safetensors, `adamw8bit.*`, 5 steps):
// the codes of both moments equal bnb's; absmax and parameters agree to fp32 rounding and to
// bnb's fast-math powers. Its kernel takes beta^t with __powf (a hardware approximation; for
// beta2 = 0.999 it moves c2 by about 3e-5 relative) and divides with __fdividef; here they are
// exact fp32 operations, so parameters differ from bnb's by up to about 5e-5 of the step (lr).
//
// The update runs as torch operations on the parameter's device (on CUDA with the bnb-exact
// quantization kernel of kernels/blockwise_quantize.h); an fp32 target on CUDA takes the fused
// kernel of kernels/adamw8bit_step.h instead, which gives the same bits in one launch.
#include "optim/adamw.h"
#include "optim/optimizer.h"

namespace qtrain::optim {

struct AdamW8bitOptions {
  AdamWOptions adamw;           // lr, betas, eps, weight_decay
  int64_t min_8bit_size = 4096;  // smaller parameters keep fp32 moments (bnb's min_8bit_size)
  // fp32 CUDA parameters (and masters) take the one-kernel step of kernels/adamw8bit_step.h;
  // false runs the torch operations there too (the reference the kernel is tested against).
  bool fused_cuda_step = true;
};

constexpr int64_t kOptimizerStateBlocksize = 256;  // bnb's blocksize for 8-bit optimizer states

class AdamW8bit : public Optimizer {
 public:
  AdamW8bit(std::vector<torch::Tensor> parameters, const AdamW8bitOptions& options);
  void step() override;
  const AdamW8bitOptions& options() const { return options_; }
  // Whether parameter `index` keeps 8-bit moments.
  bool has_8bit_state(size_t index) const;

 protected:
  std::vector<std::string> state_fields(size_t index) const override;
  StateTensorSpec state_tensor_spec(size_t index, const std::string& field) const override;

 private:
  void initialise_state(size_t index);
  // `step`: the parameter's step count, already incremented.
  void step_8bit(size_t index, int64_t step);
  void step_8bit_reference(size_t index, int64_t step);
  void step_32bit(size_t index, int64_t step);
  // bnb's two maps on `device`, copied there once.
  const std::pair<torch::Tensor, torch::Tensor>& dynamic_maps(const torch::Device& device);

  AdamW8bitOptions options_;
  std::pair<torch::Tensor, torch::Tensor> device_maps_;  // signed, unsigned
};

}  // namespace qtrain::optim
