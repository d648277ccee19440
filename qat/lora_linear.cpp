#include "qat/lora_linear.h"

#include <cmath>

#include "data/unicode_regex.h"
#include "kernels/error.h"
#include "qat/adapter_switch.h"
#include "qat/expert_linear.h"
#include "qat/lora_matmul.h"
#include "qat/qat_linear.h"

namespace qtrain::qat {

namespace F = torch::nn::functional;

double LoraOptions::scale() const {
  if (rank <= 0) throw Error(ErrorCode::kRecipe, "LoRA rank must be positive, got " + std::to_string(rank));
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

LoraLinear::LoraLinear(std::shared_ptr<LinearLayer> base, const LoraOptions& options)
    : base_(std::move(base)), options_(options), scale_(options.scale()) {
  if (!base_) throw Error(ErrorCode::kInternal, "LoraLinear needs a base layer, got none");
  if (options_.dropout < 0.0 || options_.dropout >= 1.0) {
    throw Error(ErrorCode::kRecipe, "LoRA dropout must be in [0, 1), got " + std::to_string(options_.dropout));
  }
  register_module("base_layer", base_);
  for (auto& parameter : base_->parameters()) parameter.requires_grad_(false);

  const auto device = module_device(*base_);
  lora_A_ = register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in_features(), options_.rank).bias(false)));
  lora_B_ = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(options_.rank, out_features()).bias(false)));
  lora_A_->to(device, torch::kFloat32);
  lora_B_->to(device, torch::kFloat32);
  if (options_.dora) {
    magnitude_ = register_parameter("lora_magnitude_vector",
                                    torch::empty({out_features()}, torch::TensorOptions().dtype(torch::kFloat32).device(device)));
  }
  reset();
}

void LoraLinear::reset() {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A_->weight, /*a=*/std::sqrt(5.0));
  lora_B_->weight.zero_();
  // peft's update_layer: the norms of the adapted weight as the adapter starts (B = 0: W's).
  if (magnitude_.defined()) magnitude_.copy_(adapted_row_norms(torch::kFloat32));
}

torch::Tensor LoraLinear::adapted_row_norms(torch::ScalarType dtype) const {
  torch::NoGradGuard no_grad;
  const auto lora_weight = torch::matmul(lora_B_->weight, lora_A_->weight).to(dtype);
  const auto adapted = base_->dense_weight(dtype) + scale_ * lora_weight;
  return torch::linalg_vector_norm(adapted, 2, /*dim=*/1, /*keepdim=*/false, /*dtype=*/std::nullopt).to(dtype);
}

torch::Tensor LoraLinear::adapted_row_norms_from_factors(torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  if (!base_row_squares_.defined()) {
    base_row_squares_ = base_->dense_weight(torch::kFloat32).pow(2).sum(1);  // once: W is frozen
  }
  const auto& A = lora_A_->weight;
  const auto& B = lora_B_->weight;
  auto a_products = base_->forward(A.to(dtype));  // [rank, out] = A W^T + b
  const auto bias = base_->bias();
  if (bias.defined()) a_products = a_products - bias.to(dtype);
  const auto cross = (B * a_products.t().to(torch::kFloat32)).sum(1);
  const auto quadratic = (torch::matmul(B, torch::matmul(A, A.t())) * B).sum(1);
  const auto squares = base_row_squares_.to(B.device()) + 2.0 * scale_ * cross + scale_ * scale_ * quadratic;
  return squares.clamp_min(0).sqrt().to(dtype);
}

torch::Tensor LoraLinear::dora_forward(const torch::Tensor& input) {
  const auto dtype = input.scalar_type();
  const auto scale_rows = magnitude_.to(dtype) / adapted_row_norms_from_factors(dtype);  // [out]
  if (!(options_.dropout > 0.0 && is_training())) {
    // (m / n)(x W^T + scale x A^T B^T) + b: LoRA's output rescaled.
    const auto bias = base_->bias();
    const auto adapted = lora_forward(input, 0.0);
    return bias.defined() ? (adapted - bias.to(dtype)) * scale_rows + bias.to(dtype) : adapted * scale_rows;
  }
  // Dropout: peft multiplies the dropped input by W for the rescaled part.
  const auto lora_input = F::dropout(input, F::DropoutFuncOptions().p(options_.dropout).training(true));
  const auto base_product = F::linear(lora_input, base_->dense_weight(dtype));
  const auto update = F::linear(F::linear(lora_input, lora_A_->weight.to(dtype)), lora_B_->weight.to(dtype));
  return base_->forward(input) + ((scale_rows - 1) * base_product + scale_rows * update * scale_);
}

torch::Tensor LoraLinear::forward(const torch::Tensor& input) {
  if (!adapters_enabled()) return base_->forward(input);
  if (options_.dora) return dora_forward(input);
  return lora_forward(input, is_training() ? options_.dropout : 0.0);
}

torch::Tensor LoraLinear::forward_rebuilding_input(const torch::Tensor& input, const InputRebuild& rebuild) {
  if (!adapters_enabled()) return base_->forward_rebuilding_input(input, rebuild);
  if (options_.dora) return dora_forward(input);
  return lora_forward(input, is_training() ? options_.dropout : 0.0, rebuild);
}

torch::Tensor LoraLinear::forward_for_graph(const torch::Tensor& input, const InputRebuild& rebuild) {
  if (!adapters_enabled() || options_.dora) return forward_rebuilding_input(input, rebuild);
  return lora_forward(input, is_training() ? options_.dropout : 0.0, rebuild, /*output_unread=*/true);
}

bool LoraLinear::reads_input_for_graph() const {
  // forward_for_graph's lora_matmul (output_unread) reads its input for dropout's mask only.
  const bool dropped = options_.dropout > 0.0 && is_training();
  return !adapters_enabled() || options_.dora || dropped || base_->matmul_weight_kind() == MatmulWeight::kNone;
}

torch::Tensor LoraLinear::lora_forward(const torch::Tensor& input, double dropout, const InputRebuild& rebuild,
                                       bool output_unread) {
  if (base_->matmul_weight_kind() != MatmulWeight::kNone) {
    return lora_matmul(input, base_, lora_A_->weight, lora_B_->weight, {scale_, dropout, rebuild, output_unread});
  }
  const auto dtype = input.scalar_type();
  auto lora_input = dropout > 0.0 ? F::dropout(input, F::DropoutFuncOptions().p(dropout).training(true)) : input;
  // [..., in] -> [..., rank] -> [..., out], the order peft multiplies in: lora_B(lora_A(x)) * scale.
  auto update = F::linear(F::linear(lora_input, lora_A_->weight.to(dtype)), lora_B_->weight.to(dtype));
  return base_->forward(input) + update * scale_;
}

torch::Tensor LoraLinear::dense_weight(torch::ScalarType dtype) const {
  if (!adapters_enabled()) return base_->dense_weight(dtype);
  auto merged = base_->dense_weight(torch::kFloat32) + scale_ * torch::matmul(lora_B_->weight, lora_A_->weight);
  if (magnitude_.defined()) merged = (magnitude_ / adapted_row_norms(torch::kFloat32)).unsqueeze(1) * merged;
  return merged.to(dtype);
}

void LoraLinear::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::LoraLinear(in_features=" << in_features() << ", out_features=" << out_features()
         << ", rank=" << options_.rank << ", alpha=" << options_.alpha << ", scale=" << scale_
         << ", dropout=" << options_.dropout << (options_.rslora ? ", rslora" : "") << (options_.dora ? ", dora" : "") << ")";
}

namespace {

bool has_regex_characters(const std::string& pattern) {
  return pattern.find_first_of("*+?()[]{}|^$\\") != std::string::npos;
}

// The whole name against a pattern from a recipe or an adapter config (re.fullmatch), with
// PCRE2 as peft's patterns are (data/unicode_regex.h): std::regex's recursion can overflow the
// stack on deep nesting and backtracks without bound; PCRE2's nesting and match limits turn
// such a pattern into an Error naming it.
bool full_regex_match(const std::string& pattern, const std::string& text) {
  const std::string where = "target_modules pattern '" + pattern + "'";
  return data::UnicodeRegex(pattern, where, ErrorCode::kRecipe).full_match(text);
}

bool ends_with_component(const std::string& name, const std::string& suffix) {
  if (name == suffix) return true;
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         name[name.size() - suffix.size() - 1] == '.';
}

// peft's "all-linear": every linear layer but the output projection.
constexpr const char* kAllLinear = "all-linear";
bool is_output_layer(const std::string& name) { return name == "lm_head"; }

}  // namespace

bool ModuleSelector::is_extended_entry(const std::string& entry) {
  return entry == kAllLinear || has_regex_characters(entry);
}

bool ModuleSelector::matches(const std::string& module_name) const {
  if (regex) {
    if (*regex == kAllLinear) return !is_output_layer(module_name);
    return full_regex_match(*regex, module_name);
  }
  for (const auto& entry : names) {
    if (entry == kAllLinear) {
      if (!is_output_layer(module_name)) return true;
    } else if (has_regex_characters(entry) ? full_regex_match(entry, module_name)
                                           : ends_with_component(module_name, entry)) {
      return true;
    }
  }
  return false;
}

std::string ModuleSelector::describe() const {
  if (regex) return "'" + *regex + "'";
  std::string text = "[";
  for (size_t index = 0; index < names.size(); ++index) text += (index ? ", \"" : "\"") + names[index] + "\"";
  return text + "]";
}

bool LoraTargets::matches(const std::string& module_name) const {
  const bool parameter = !parameters.empty() && (parameters.matches(module_name) || parameters.matches(module_name + ".weight"));
  return (include.matches(module_name) || parameter) && !exclude.matches(module_name);
}

std::vector<LoraTarget> find_lora_targets(const torch::nn::Module& root, const LoraTargets& targets) {
  // Adapters already in place, bare or inside a QAT layer (which fake-quantizes their merge).
  const auto is_adapter = [](const LinearLayer& layer) {
    if (dynamic_cast<const ExpertLora*>(&layer) != nullptr) return true;
    if (const auto* quantized = dynamic_cast<const QatLinear*>(&layer)) {
      return dynamic_cast<const LoraLinear*>(quantized->inner().get()) != nullptr;
    }
    return dynamic_cast<const LoraLinear*>(&layer) != nullptr;
  };
  return find_linear_layers(
      root, [&](const std::string& name, const LinearLayer& layer) { return !is_adapter(layer) && targets.matches(name); },
      is_adapter);
}

std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraTargets& targets,
                                    const LoraOptionsForModule& options_for) {
  const auto found = find_lora_targets(root, targets);
  if (found.empty()) {
    throw Error(ErrorCode::kRecipe, "no linear layer matches the LoRA target modules " + targets.include.describe() +
                " (module names look like 'model.layers.0.self_attn.q_proj')");
  }
  const auto banks = expert_banks(root);  // a mixture of experts' banks get ExpertLora
  std::vector<std::string> wrapped;
  for (const auto& target : found) {
    const auto bank = banks.find(target.name);
    if (bank != banks.end()) {
      auto lora = std::make_shared<ExpertLora>(target.layer, bank->second, options_for(target.name));
      lora->train(target.layer->is_training());
      replace_linear_layer_at(root, target.name, lora);
      wrapped.push_back(target.name);
      continue;
    }
    auto lora = std::make_shared<LoraLinear>(target.layer, options_for(target.name));
    lora->train(target.layer->is_training());  // a model in eval mode stays there: no dropout
    replace_linear_layer_at(root, target.name, lora);
    wrapped.push_back(target.name);
  }
  return wrapped;
}

std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraTargets& targets, const LoraOptions& options) {
  return apply_lora(root, targets, [&](const std::string&) { return options; });
}

}  // namespace qtrain::qat
