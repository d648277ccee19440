#pragma once
// LoRA (Hu et al. 2021) as peft implements it: a frozen base linear layer plus a trainable
// low-rank update,
//
//     y = base(x) + scale * (dropout(x) A^T) B^T,   A [rank, in], B [out, rank],
//     scale = alpha / rank   (alpha / sqrt(rank) with rsLoRA),
//
// with A and B kept as fp32 master weights whatever the base's dtype. The module tree mirrors
// peft's (`q_proj.base_layer.weight`, `q_proj.lora_A.weight`, `q_proj.lora_B.weight`), so
// named_parameters() gives the names peft saves, without its `.default` adapter name.
//
// DoRA (Liu et al. 2024; LoraOptions::dora, peft's use_dora) adds a trained magnitude m [out]
// (`q_proj.lora_magnitude_vector`, initialised to the row norms of W + scale B A) and rescales
// each output row of the adapted weight to it, as peft's DoraLinearLayer computes:
//
//     n = ||W + scale * B A||_row  (in the input's dtype, no gradient: the paper's section 4.3)
//     y = base(x) + (m / n - 1) * (x W^T) + (m / n) * scale * (dropout(x) A^T) B^T
//
// where x W^T is the base's output without its bias (or, with dropout active, the dropped
// input's product, as peft). The merged weight is (m / n) * (W + scale B A).
//
// Without dropout that is (m / n) * (x W^T + scale x A^T B^T) + b: LoRA's own output (the fused
// node on a 4-bit base) rescaled per row. n is taken without a copy of W per step:
// n^2 = ||W||^2 + 2 scale <W, B A> + scale^2 ||B A||^2 per row, with ||W||^2 kept from the first
// step (W is frozen), <W, B A>_o = sum_k B[o, k] (A W^T)[k, o] from the base's own product of the
// r rows of A, and ||B A||^2_o = (B (A A^T) B^T)_oo, in fp32. peft materialises W + scale B A in
// the input's dtype instead: the two agree to fp32 rounding (bf16's, where peft rounds in bf16).
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/linear.h"
#include "qat/lora_options.h"

namespace qtrain::qat {

class LoraLinear : public LinearLayer {
 public:
  // `base` becomes the child `base_layer` and is frozen (its parameters stop requiring grad).
  // A and B are created fp32 on the base's device and initialised by reset().
  LoraLinear(std::shared_ptr<LinearLayer> base, const LoraOptions& options);

  // peft's initialisation: A kaiming-uniform with a = sqrt(5) (torch.nn.Linear's default,
  // bound 1/sqrt(in)), B zero, so a fresh adapter leaves the base's output unchanged.
  void reset();

  // input [..., in] -> [..., out] in the input's dtype; the LoRA branch runs in that dtype
  // too (A and B cast to it, as peft's layers run under autocast).
  torch::Tensor forward(const torch::Tensor& input) override;
  // Over a base that fuses (lora_matmul), backward rebuilds the input A's gradient reads instead
  // of keeping it.
  torch::Tensor forward_rebuilding_input(const torch::Tensor& input, const InputRebuild& rebuild) override;
  // Over a base that fuses, without DoRA (whose magnitude's gradient reads the output): the
  // output's values are left unwritten and the base's product skipped (lora_matmul's output_unread).
  torch::Tensor forward_for_graph(const torch::Tensor& input, const InputRebuild& rebuild) override;
  bool reads_input_for_graph() const override;
  int64_t in_features() const override { return base_->in_features(); }
  int64_t out_features() const override { return base_->out_features(); }
  // The merged weight W + scale * B A, computed in fp32 and returned in `dtype`.
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  torch::Tensor bias() const override { return base_->bias(); }
  void pretty_print(std::ostream& stream) const override;

  const LoraOptions& options() const { return options_; }
  double scale() const { return scale_; }
  const std::shared_ptr<LinearLayer>& base_layer() const { return base_; }
  const torch::Tensor& lora_A() const { return lora_A_->weight; }  // [rank, in], fp32
  const torch::Tensor& lora_B() const { return lora_B_->weight; }  // [out, rank], fp32
  const torch::Tensor& lora_magnitude() const { return magnitude_; }  // [out], fp32; undefined without DoRA

 private:
  // ||W + scale B A|| per output row, in `dtype`, without gradient: from the dense weight (the
  // magnitude's start, the merge) or from the factors (every step; above).
  torch::Tensor adapted_row_norms(torch::ScalarType dtype) const;
  torch::Tensor adapted_row_norms_from_factors(torch::ScalarType dtype);
  // output_unread: lora_matmul's, over a base that fuses; the unfused composition computes it anyway.
  torch::Tensor lora_forward(const torch::Tensor& input, double dropout, const InputRebuild& rebuild = {},
                             bool output_unread = false);
  torch::Tensor dora_forward(const torch::Tensor& input);

  std::shared_ptr<LinearLayer> base_;
  torch::nn::Linear lora_A_{nullptr};
  torch::nn::Linear lora_B_{nullptr};
  torch::Tensor magnitude_;
  torch::Tensor base_row_squares_;  // DoRA: ||W||^2 per row, fp32, from the first step
  LoraOptions options_;
  double scale_;
};

using LoraTarget = NamedLinearLayer;

// The linear layers under `root` that `targets` selects, in module order. Layers already
// wrapped by a LoraLinear (and the bases inside them), bare or inside a QatLinear, are not
// targets again.
std::vector<LoraTarget> find_lora_targets(const torch::nn::Module& root, const LoraTargets& targets);

using LoraOptionsForModule = std::function<LoraOptions(const std::string& module_name)>;

// Wraps every target of `root` in a LoraLinear (options per module: peft's rank_pattern /
// alpha_pattern) and returns the wrapped names. An Error when nothing matches, as in peft.
std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraTargets& targets,
                                    const LoraOptionsForModule& options_for);
std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraTargets& targets, const LoraOptions& options);

}  // namespace qtrain::qat
