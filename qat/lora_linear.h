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
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/linear.h"

namespace qtrain::qat {

struct LoraOptions {
  int64_t rank = 8;      // peft's `r`
  double alpha = 16.0;   // peft's `lora_alpha`
  double dropout = 0.0;  // on the LoRA branch's input, in training only
  bool rslora = false;   // scale by alpha / sqrt(rank) instead of alpha / rank
  double scale() const;
};

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

 private:
  std::shared_ptr<LinearLayer> base_;
  torch::nn::Linear lora_A_{nullptr};
  torch::nn::Linear lora_B_{nullptr};
  LoraOptions options_;
  double scale_;
};

// Which modules get an adapter, in peft's `target_modules` terms. Module names are dotted
// paths from the model's root ("model.layers.0.self_attn.q_proj").
struct ModuleSelector {
  // peft's list form: a module matches when its name equals an entry or ends with "." + the
  // entry ("q_proj", "self_attn.q_proj"). An entry holding regex characters other than '.'
  // (`*+?()[]{}|^$\`) must match the whole name as a regular expression instead (a recipe
  // convenience). "all-linear" selects every linear layer except the output layer `lm_head`,
  // as peft does.
  std::vector<std::string> names;
  // peft's string form: one regular expression the whole name must match (re.fullmatch).
  std::optional<std::string> regex;

  bool empty() const { return names.empty() && !regex; }
  // Whether a list entry is one of the recipe conveniences above, which peft's list form
  // would read literally.
  static bool is_extended_entry(const std::string& entry);
  bool matches(const std::string& module_name) const;
  std::string describe() const;  // for messages: ["q_proj", "v_proj"] or the regex
};

struct LoraTargets {
  ModuleSelector include;  // peft's target_modules
  ModuleSelector exclude;  // peft's exclude_modules
  bool matches(const std::string& module_name) const;
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
