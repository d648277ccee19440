#pragma once
// What a LoRA adapter is made of (rank, alpha, dropout) and which modules get one, as plain
// data: recipes and peft's adapter_config.json are read into these (qat/lora_linear.h applies
// them). Free of LibTorch.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qtrain::qat {

// rank and alpha default to what a recipe gets (lora.rank / lora.alpha take these), as Unsloth's
// and axolotl's QLoRA examples set them; peft's own defaults (r 8, lora_alpha 8) apply where an
// adapter_config.json omits them (trainer/formats/peft_adapter_config.cpp). dropout defaults to
// none for a layer built directly; a recipe's lora.dropout (default 0, as peft's) sets it for training runs.
struct LoraOptions {
  int64_t rank = 16;     // peft's `r`
  double alpha = 32.0;   // peft's `lora_alpha`
  double dropout = 0.0;  // on the LoRA branch's input, in training only
  bool rslora = false;   // scale by alpha / sqrt(rank) instead of alpha / rank
  bool dora = false;     // peft's use_dora: the weight-decomposed update (qat/lora_linear.h)
  double scale() const;
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
  // peft's target_parameters, by parameter name: an expert bank's own name
  // ("model.layers.0.mlp.experts.gate_up_proj", transformers' 3D parameter), another layer's
  // NAME.weight ("mlp.gate.weight", a router). Entries match as target_modules' list form does.
  ModuleSelector parameters;
  bool matches(const std::string& module_name) const;
};

}  // namespace qtrain::qat
